"""test_multiturn.py's environment, a file of its own so that the engine pool's chat-model engine can start with it
(engine_pool.CHAT_CONFIG: rollout.env is read when an engine starts). A random tiny model never calls a tool by
itself, so the env answers the first turn with a `tool` message and the second with a `user` message whatever the
model said, and ends the episode after the third turn. An example's `mode` field makes its second step raise, hang
or break the contract instead, or (mode "broken") its reset raise."""
import time


class Scripted:
    def __init__(self, mode="ok", **_):
        self.mode, self.n = mode, 0

    def reset(self):
        if self.mode == "broken":
            raise RuntimeError("no sandbox available")
        return None

    def step(self, text):
        self.n += 1
        if self.mode == "raise" and self.n == 2:
            raise ValueError("the environment broke")
        if self.mode == "hang" and self.n == 2:
            time.sleep(120)
        if self.mode == "garbage" and self.n == 2:
            return ["not", "a", "dict"]
        if self.n == 1:
            return {"messages": [{"role": "tool", "content": "42"}], "done": False, "reward": 0.25}
        if self.n == 2:
            return {"messages": [{"role": "user", "content": "Thanks. Now the answer?"}], "done": False}
        return {"messages": [], "done": True, "reward": 1.0}
