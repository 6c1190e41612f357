"""Optional Ray backend: the critic and reward models on their own role groups, behind the unchanged Trainer API.

A role group is a placement group of `num_workers` bundles (`num_gpus_per_worker` GPUs, `num_cpus_per_worker`
CPUs each) holding one actor per bundle. The trainer process never holds these models: it sends token ids or
texts through Ray's object store and gets scores, values or update statistics back. Every remote call has a
timeout; a worker that dies or stalls is reported as an error naming its role (`RoleError`).

With several workers, a role is data parallel inside its group: rows are split over the workers, and the critic's
workers form their own torch.distributed group (gloo on CPU, NCCL on GPU) to average gradients.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


class RoleError(RuntimeError):
    """A role group's worker died, stalled past its timeout, or could not start."""


@dataclass
class Placement:
    num_workers: int = 1
    num_gpus_per_worker: float = 0.0
    num_cpus_per_worker: float = 1.0

    @classmethod
    def from_config(cls, value: dict | None, field_name: str) -> Placement:
        value = dict(value or {})
        unknown = set(value) - {"num_workers", "num_gpus_per_worker", "num_cpus_per_worker"}
        if unknown:
            raise ValueError(
                f"{field_name} has unknown keys {sorted(unknown)}; use num_workers, "
                "num_gpus_per_worker, num_cpus_per_worker"
            )
        placement = cls(**value)
        if placement.num_workers < 1:
            raise ValueError(f"{field_name}.num_workers={placement.num_workers}: use at least 1")
        # GPUs are not checked here: on a cluster they may exist only on worker nodes. A placement the cluster
        # cannot satisfy fails as a RoleError when its placement group is not ready within ray_call_timeout.
        return placement


def init_ray(address: str | None = None) -> None:
    """Connect to `address`, or start a local cluster (token auth off for it: local tests, no network)."""
    import ray

    if ray.is_initialized():
        return
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)


class _RoleWorker:
    """Runs inside a Ray actor: loads its model from a path and serves one role ('reward' or 'critic')."""

    def __init__(self, role: str, model_path: str, settings: dict):
        torch.set_num_threads(max(1, int(settings.get("num_threads", 1))))
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.role = role
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1).to(self.device)
        if role == "reward":
            self.tokenizer = AutoTokenizer.from_pretrained(settings.get("tokenizer_path") or model_path)
            model.config.pad_token_id = self.tokenizer.pad_token_id  # pooling at the last non-pad token, as TRL
            model.eval()
            self.model = model
        else:
            from ..critic import CriticUpdater

            self.updater = CriticUpdater(model, **settings["updater"])

    def ping(self) -> str:
        return self.role

    def rendezvous_address(self) -> tuple[str, int]:
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_process_group(self, rank: int, world_size: int, address: str, port: int) -> None:
        """Join the group's own process group and start from rank 0's weights."""
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size)
        with torch.no_grad():
            for parameter in self.updater.critic.parameters():
                dist.broadcast(parameter.data, src=0)

    @torch.no_grad()
    def rewards(self, texts: list[str]) -> list[float]:
        inputs = self.tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        ).to(self.device)
        return self.model(**inputs).logits[:, 0].float().cpu().tolist()

    def values(self, input_ids, attention_mask, prompt_len, num_tokens):
        return self.updater.values(
            input_ids.to(self.device), attention_mask.to(self.device), prompt_len, num_tokens
        ).cpu()

    def step(self, input_ids, attention_mask, prompt_len, old_values, returns, mask, train, loss_scale=1.0):
        args = [t.to(self.device) for t in (input_ids, attention_mask)]
        loss, stats = self.updater.step(
            *args,
            prompt_len,
            old_values.to(self.device),
            returns.to(self.device),
            mask.to(self.device),
            train=train,
            loss_scale=loss_scale,
        )
        return loss.cpu(), {k: v.cpu() for k, v in stats.items()}

    def set_scheduler(self, *args):
        self.updater.set_scheduler(*args)

    def state(self):
        return self.updater.state()

    def load_state(self, state):
        self.updater.load_state(state)


class RoleGroup:
    """One role's placement group and worker, with bounded remote calls."""

    def __init__(self, role: str, model_path: str, placement: Placement, settings: dict, timeout: float = 300.0):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.role, self.timeout = role, timeout
        bundle = {"CPU": placement.num_cpus_per_worker}
        if placement.num_gpus_per_worker:
            bundle["GPU"] = placement.num_gpus_per_worker
        self.placement_group = placement_group([bundle] * placement.num_workers, strategy="PACK")
        self._call(self.placement_group.ready(), "placement")
        self.workers = []
        for index in range(placement.num_workers):
            actor = ray.remote(_RoleWorker).options(
                num_cpus=placement.num_cpus_per_worker,
                num_gpus=placement.num_gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=index
                ),
                max_restarts=0,
            )
            self.workers.append(actor.remote(role, model_path, settings))
        try:
            self._call([w.ping.remote() for w in self.workers], "start")
            if role == "critic" and len(self.workers) > 1:
                address, port = self._call(self.workers[0].rendezvous_address.remote(), "rendezvous")
                world = len(self.workers)
                refs = [w.init_process_group.remote(i, world, address, port) for i, w in enumerate(self.workers)]
                self._call(refs, "process group")
        except RoleError as error:
            raise RoleError(f"{role} group could not start its workers for {model_path!r}: {error}") from error

    @property
    def worker(self):
        return self.workers[0]

    def _call(self, ref, what: str):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(ref, timeout=self.timeout)
        except GetTimeoutError as error:
            raise RoleError(
                f"{self.role} group: {what} took longer than {self.timeout}s (ray_call_timeout)"
            ) from error
        except RayActorError as error:
            raise RoleError(f"{self.role} group: its worker died during {what}: {error}") from error

    def call(self, method: str, *args):
        """`method` on the first worker (state, one-off queries)."""
        return self._call(getattr(self.worker, method).remote(*args), method)

    def call_all(self, method: str, *args):
        return self._call([getattr(w, method).remote(*args) for w in self.workers], method)

    def shutdown(self) -> None:
        """Kill the workers and free the placement group's resources (Ray keeps placement groups until removed)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.placement_group is None:
            return
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        remove_placement_group(self.placement_group)
        self.placement_group = None

    def __del__(self):
        try:
            import ray

            if ray.is_initialized():
                self.shutdown()
        except Exception:  # interpreter shutdown or a cluster already gone: nothing left to free
            pass


class RayCritic:
    """The `CriticUpdater` interface, served by a critic role group. With several workers the rows are split over
    them; each shard's loss is weighted by its share of the tokens, so averaging gradients over the workers gives
    exactly the full batch's update."""

    def __init__(self, group: RoleGroup):
        self.group = group
        self.scheduler = None  # mirrors CriticUpdater: set once the step count is known

    def _shards(self, *tensors):
        n = len(self.group.workers)
        if tensors[0].size(0) < n:
            raise RoleError(
                f"critic group has {n} workers but the batch has {tensors[0].size(0)} rows; "
                "use fewer critic workers or a larger per_device_train_batch_size"
            )
        return list(zip(*(t.cpu().tensor_split(n) for t in tensors)))

    def values(self, input_ids, attention_mask, prompt_len, num_tokens):
        shards = self._shards(input_ids, attention_mask)
        refs = [w.values.remote(ids, am, prompt_len, num_tokens) for w, (ids, am) in zip(self.group.workers, shards)]
        return torch.cat(self.group._call(refs, "values")).to(input_ids.device)

    def step_async(self, input_ids, attention_mask, prompt_len, old_values, returns, mask, train=True):
        """Start the critic's update on its group and return at once; `.result()` waits (bounded) for it, so the
        policy's update runs meanwhile."""
        device = input_ids.device
        shards = self._shards(input_ids, attention_mask, old_values, returns, mask)
        total = mask.sum().clamp(min=1.0).item()
        weights = [s[4].sum().item() / total for s in shards]
        world = len(shards)
        refs = [
            w.step.remote(*shard[:2], prompt_len, *shard[2:], train, weight * world)
            for w, shard, weight in zip(self.group.workers, shards, weights)
        ]
        group = self.group

        class Pending:
            def result(self):
                results = group._call(refs, "step")
                loss = sum(weight * r[0] for weight, r in zip(weights, results))
                stats = {k: sum(weight * r[1][k] for weight, r in zip(weights, results)) for k in results[0][1]}
                return loss.to(device), {k: v.to(device) for k, v in stats.items()}

        return Pending()

    def step(self, *args, **kwargs):
        return self.step_async(*args, **kwargs).result()

    def set_scheduler(self, *args):
        self.group.call_all("set_scheduler", *args)
        self.scheduler = True

    def state(self):
        return self.group.call("state")  # workers hold identical weights

    def load_state(self, state):
        self.group.call_all("load_state", state)


class RayRewardModel:
    """A reward model on its own role group, as a TRL reward function: texts in, one score per completion out.
    Texts are built as TRL builds them for a local reward model (chat template for conversations, else
    prompt + completion), and tokenized by the worker with the model's own tokenizer."""

    def __init__(self, group: RoleGroup, name: str, chat_tokenizer=None):
        self.group, self.__name__, self.chat_tokenizer = group, name, chat_tokenizer

    def __call__(self, prompts, completions, **kwargs) -> list[float]:
        if prompts and isinstance(prompts[0], list):
            texts = [
                self.chat_tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)
            ]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        n = len(self.group.workers)
        shards = [texts[i::n] for i in range(n)]
        results = self.group._call(
            [w.rewards.remote(shard) for w, shard in zip(self.group.workers, shards) if shard], "rewards"
        )
        scores = [0.0] * len(texts)
        for i, shard_scores in enumerate(results):
            scores[i::n] = shard_scores
        return scores
