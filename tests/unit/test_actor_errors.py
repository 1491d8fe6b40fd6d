"""cluster/launch/waits.py actor_error: the driver's message carries the actor's own exception (issue 30 case 9)."""
from cluster.launch.waits import actor_error

# Ray 2.60's text for an actor whose constructor raised (RolloutWorker on a model with head_dim 16, as
# the console showed it, colours included).
CREATION_ERROR = ("The actor died because of an error raised in its creation task, \x1b[36mray::RolloutWorker."
                  "__init__()\x1b[39m (pid=32431, ip=192.0.2.2, actor_id=3e43, repr=<RolloutWorker object at 0x7f44>)\n"
                  """  File "/work/actors/rollout.py", line 154, in __init__
    self._warm_up()
           ^^^^^^^^^^^^^^^
  File "/venv/torch/_ops.py", line 1279, in __call__
    return self._op(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^
RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0""")

PYDANTIC = """The actor died because of an error raised in its creation task, ray::RolloutWorker.__init__() (pid=1)
  File "/venv/vllm/config/model.py", line 40, in __post_init__
    raise ValueError(msg)
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (4096) is greater than the derived max_model_len (512)
    For further information visit https://errors.pydantic.dev/2.12/v/value_error"""

KILLED = """The actor died unexpectedly before finishing this task.
\tclass_name: LearnerWorker
\tpid: 77
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR"""


def test_the_actors_own_exception_is_taken_from_rays_text():
    assert actor_error(RuntimeError(CREATION_ERROR)) == (
        "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0")
    assert actor_error(RuntimeError(PYDANTIC)) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig ... Value error, "
        "User-specified max_model_len (4096) is greater than the derived max_model_len (512)")
    assert actor_error(RuntimeError(KILLED)) == "The actor died unexpectedly before finishing this task."
