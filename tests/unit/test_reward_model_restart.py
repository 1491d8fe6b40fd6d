"""A reward model that answers from a new process (Ray restarted it and ran the call again): counted, said,
and handed to the driver once (`restarted_actors`), which gives it its threads again and updates
placement.json (cluster/driver/comebacks.py `Comebacks.reward_models_back`; end to end: tests/e2e/test_lost_host.py)."""
from actors.rewards import model


def test_a_reward_model_answering_from_a_new_process_is_counted_said_and_handed_over_once(monkeypatch, capsys):
    monkeypatch.setattr(model, "wait_for", lambda ref, who, what, timeout_s: ref)  # the call's answer, as Ray gives it
    pids = iter([101, 101, 202, 202])

    def call():
        return {"values": [1.0], "truncated": 0, "seconds": 0.0, "pid": next(pids)}

    rm = model.RewardModels(["model:/models/rm"])
    rm.attach("model:/models/rm", handle=None, timeout_s=5.0)
    for _ in range(2):
        rm._wait("model:/models/rm", None, call, 1)
    assert rm.restarts == 0 and rm.restarted_actors() == []
    rm._wait("model:/models/rm", None, call, 1)  # pid 202: Ray restarted it
    assert rm.restarts == 1
    assert "reward model /models/rm was restarted (process 101 -> 202)" in capsys.readouterr().out
    assert rm.restarted_actors() == ["model:/models/rm"] and rm.restarted_actors() == []  # taken once
    rm._wait("model:/models/rm", None, call, 1)  # the same new process again: nothing new
    assert rm.restarts == 1 and rm.restarted_actors() == []
    rm.close()
