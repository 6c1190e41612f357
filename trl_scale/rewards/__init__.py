"""Rewards as services, plain reward functions for `reward_funcs` of every trainer:

- `CodeExecutionReward` (`code.py`): runs the code a completion holds against the row's tests in a sandbox
  (`sandbox.py`: bubblewrap under resource limits); the reward is the fraction passed;
- `RemoteReward` / `AsyncRemoteReward` (`remote.py`): scores on reward servers over HTTP in OpenRLHF's contract
  (`contract.py`), routed and failed over by the rollout router's rotation;
- `trl-scale reward-server` (`server.py`): a reference server of that contract, the code verifier behind HTTP.

Nothing here imports torch or TRL.
"""

from .code import CodeExecutionReward, TestOutcome, extract_code
from .contract import OpenRLHFContract, RewardContract, RewardServiceError
from .remote import AsyncRemoteReward, RemoteReward, RemoteRewardSettings
from .sandbox import RunResult, Sandbox, SandboxSettings, SandboxUnavailable

__all__ = [
    "AsyncRemoteReward",
    "CodeExecutionReward",
    "OpenRLHFContract",
    "RemoteReward",
    "RemoteRewardSettings",
    "RewardContract",
    "RewardServiceError",
    "RunResult",
    "Sandbox",
    "SandboxSettings",
    "SandboxUnavailable",
    "TestOutcome",
    "extract_code",
]
