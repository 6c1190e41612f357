"""A real OpenEnv environment server for the environment tests: a counting game (the agent says number words; each
word the environment has not heard in this episode earns 1), served by OpenEnv's own `create_app` with uvicorn on
127.0.0.1, concurrent WebSocket sessions declared. Run as `python -m tests.openenv_counter PORT`.

`CountingClientEnvironment` is what a TRL user passes as `environment_factory`, written as TRL's OpenEnv examples
write theirs: a no-argument constructor opening a client session, `reset` returning the first observation, a tool
method that steps the environment, `get_reward` reading what the session earned; `__exit__` closes the session."""

from __future__ import annotations

import sys

from openenv.core.env_server import Environment, create_app
from openenv.core.env_server.types import Action, Observation, State


class SayAction(Action):
    word: str


class HeardObservation(Observation):
    text: str = ""


class CountingEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one environment per WebSocket session, many sessions at once

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self._heard: set[str] = set()

    def reset(self, seed=None, episode_id=None, **kwargs) -> HeardObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self._heard = set()
        return HeardObservation(text="", reward=0.0, done=False)  # the prompt as the toy tool model learned it

    def step(self, action: SayAction, timeout_s=None, **kwargs) -> HeardObservation:
        self._state.step_count += 1
        new = action.word not in self._heard
        self._heard.add(action.word)
        return HeardObservation(text=f"heard {action.word}", reward=1.0 if new else 0.0, done=False)

    @property
    def state(self) -> State:
        return self._state


app = create_app(CountingEnvironment, SayAction, HeardObservation, max_concurrent_envs=256)


class CountingClientEnvironment:
    """The `environment_factory` wrapping an OpenEnv client session (set `url` first)."""

    url: str = ""
    words = ("five", "six", "seven")

    def __init__(self):
        from openenv.core.generic_client import GenericEnvClient

        self.client = GenericEnvClient(base_url=self.url, message_timeout_s=30).sync()
        self.client.connect()
        self.reward, self.ticks = 0.0, 0

    def reset(self, **row) -> str:
        self.reward, self.ticks = 0.0, 0
        return self.client.reset().observation["text"]

    def tick(self) -> str:
        """The next number word."""
        word = self.words[self.ticks % len(self.words)]
        self.ticks += 1
        result = self.client.step({"word": word})
        self.reward += result.reward or 0.0
        return result.observation["text"]

    def get_reward(self) -> float:
        return self.reward

    def __exit__(self, *exc) -> None:
        self.client.close()


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
