"""A remote verifier that refuses raygrpo's credentials stops the run at its first step, naming the URL and the
missing token (issue 58: formerly tests/e2e/test_reward_verifier.py, a whole `raygrpo train` with an engine, a
learner group and a Ray cluster for a refusal the driver decides at its reward seam).

The verifier is examples/verifier_server.py started as a user starts it: its own process on 127.0.0.1 with
--token, serving https with a certificate a CA of the test's own signed (in no system store, as a company's
internal CA), which the user's config trusts with reward.http_ca_file, a path relative to the user's directory.
raygrpo runs without RAYGRPO_REWARD_TOKEN. The 401 reaching raygrpo shows the TLS connection was made.
  - the driver's loop (tests/unit/test_driver_seam.py's run over tests/fakes) with the real RewardScorer: the
    refusal ends the run at step 1 with no step logged and nothing trained;
  - the CLI (`raygrpo train`, cluster/cli.py main, the real Trainer.run and its config and reward scorer from the
    user's YAML; no actors started): one line on stderr without a traceback, exit 1, the run dir's lock released.
That a 401 is asked once and not retried: tests/unit/test_reward_http_bounds.py."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from local_http import example_verifier

from actors.config import RewardConfig
from actors.rewards.http import TOKEN_ENV, VerifierRefused
from actors.rewards.scorer import RewardScorer
from cluster.cli import main
from cluster.driver.trainer import Trainer
from cluster.models.tinymodel import TinyModelSpec, build_tiny_model
from cluster.run.metrics import read_metrics
from tests.unit.test_driver_seam import run, train

CA_FILE = "pki/ca.pem"  # reward.http_ca_file as the user writes it: relative to the directory raygrpo runs in


@pytest.fixture
def user_dir(tmp_path, monkeypatch) -> Path:
    """The user's directory, the working directory here: the test's CA and the verifier's certificate under
    pki/; RAYGRPO_REWARD_TOKEN not set (nor RAYGRPO_DEBUG, which would print the traceback on purpose)."""
    tls_certs = pytest.importorskip("tls_certs", reason="the `cryptography` package makes the test's CA and certificate")
    (tmp_path / "pki").mkdir()
    tls_certs.make_pki(tmp_path / "pki")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv("RAYGRPO_DEBUG", raising=False)
    return tmp_path


@pytest.fixture
def verifier_url(user_dir):
    """examples/verifier_server.py --token over https, as a user starts it; its URL (the last word it prints)."""
    pki = user_dir / "pki"
    with example_verifier("--token", "s3cret", "--cert", str(pki / "good.pem"), "--key", str(pki / "good.key")) as url:
        assert url.startswith("https://127.0.0.1:"), url
        yield url


def steps_logged(run_dir: Path) -> list[int]:
    """The steps metrics.jsonl has a row of (none: the logger writes the file with its first row)."""
    return [row["step"] for row in read_metrics(run_dir)] if (run_dir / "metrics.jsonl").exists() else []


def said_the_refusal(text: str, url: str) -> bool:
    return f"the reward verifier {url} refused raygrpo's request: HTTP 401" in text and \
        f"{TOKEN_ENV} is not set" in text


def test_the_driver_stops_at_the_first_step_naming_the_url_and_the_missing_token(user_dir, verifier_url, monkeypatch):
    run_dir = user_dir / "run"
    run_dir.mkdir()
    cfg = RewardConfig(functions=[verifier_url], http_ca_file=CA_FILE, http_timeout_s=3, http_max_batch=8,
                       http_max_retries=2)
    with RewardScorer(cfg) as scorer:
        r = run(run_dir, monkeypatch, steps=3, scorer=scorer)
        with pytest.raises(VerifierRefused) as refused:
            train(r)
    assert said_the_refusal(str(refused.value), verifier_url), str(refused.value)
    assert steps_logged(run_dir) == [] and r.rank.batches == []  # no step logged, nothing trained
    assert [len(e.served) for e in r.engines] == [1, 1]  # step 1 was sampled: the refusal came at its scoring


def test_the_cli_says_the_refusal_in_one_line_exits_1_and_releases_the_run_dir(user_dir, verifier_url, monkeypatch,
                                                                             capsys):
    """`raygrpo train` on the user's YAML: the config, the data and the reward scorer are the real ones
    (Trainer.__init__), and so is Trainer.run around the loop (the run dir's lock, the failure's path); no actors
    are started (_setup does nothing) and the loop scores one batch as a step does, the refusal raised from there."""
    model = build_tiny_model(user_dir / "model", TinyModelSpec(num_layers=1))
    (user_dir / "verifier.yaml").write_text(textwrap.dedent(f"""
        model: {{path: {model}}}
        data: {{train: "task:addition", task_digits: 1, num_eval: 0}}
        trainer: {{run_dir: {user_dir / 'run'}, steps: 3, prompts_per_step: 4, group_size: 4}}
        metrics: {{tensorboard: false}}
        reward:
          functions: ["{verifier_url}"]
          http_ca_file: {CA_FILE}
          http_timeout_s: 3
          http_max_retries: 2
    """))
    monkeypatch.setattr(Trainer, "_setup", lambda self: None)
    monkeypatch.setattr(Trainer, "_train", lambda self: self.scorer.score(["1+1="], ["2"], [{"answer": "2"}]))
    assert main(["train", "verifier.yaml"]) == 1
    err = capsys.readouterr().err
    assert said_the_refusal(err, verifier_url) and "raygrpo: run failed: the reward verifier" in err, err
    assert "Traceback" not in err, err
    assert steps_logged(user_dir / "run") == []
    assert not (user_dir / "run" / "raygrpo.lock").exists()
