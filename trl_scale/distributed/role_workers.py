"""What runs inside a role group's Ray actors: the reward model, the critic (forward and update) and the reference
policy, each loaded from a path and fed `RoleRows` (token ids without padding) or texts."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch

from ..scoring.packing import UnpaddedRows

if TYPE_CHECKING:
    from ..critic.base import CriticSettings
    from ..scoring import ScoringSettings


@dataclass(frozen=True)
class RewardWorkerSettings:
    """A reward worker scores texts with the tokenizer TRL would load for that reward model."""

    tokenizer_path: str


@dataclass(frozen=True)
class CriticWorkerSettings:
    """A critic worker: its updater's settings, the seed of a new value head (as the local critic's), and how its
    group holds the critic across workers (FSDP2 needs the group's process group: with several workers only)."""

    updater: CriticSettings
    seed: int
    sharding: Literal["fsdp2", "replicated"] = "replicated"


@dataclass(frozen=True)
class ReferenceWorkerSettings:
    """A reference worker loads the policy's checkpoint as TRL loads its reference (dtype, attention kernel) and
    scores it as the trainer scores the policy (`scoring`: temperature, fp32 head, packing), under the trainer's
    mixed precision (`autocast_dtype`, e.g. "bfloat16")."""

    scoring: ScoringSettings
    dtype: str | None = None
    attn_implementation: str | None = None
    autocast_dtype: str | None = None


RoleWorkerSettings = RewardWorkerSettings | CriticWorkerSettings | ReferenceWorkerSettings


@dataclass
class RoleRows:
    """One trainer rank's rows for a role (or one worker's shard of them), as they cross the object store: the
    critic's values and update, the reference's log-probs. ``num_tokens`` completion tokens end each row's real
    tokens' span; ``old_values``, ``returns`` and ``mask`` (``[B, num_tokens]``) only for the critic's update."""

    rows: UnpaddedRows
    prompt_len: int
    num_tokens: int
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    loss_scale: float = 1.0

    def split(self, n: int) -> list[RoleRows]:
        rows = self.rows.split(n)
        if self.mask is None:
            return [replace(self, rows=r) for r in rows]
        parts = zip(rows, self.old_values.tensor_split(n), self.returns.tensor_split(n), self.mask.tensor_split(n))
        return [replace(self, rows=r, old_values=v, returns=g, mask=m) for r, v, g, m in parts]


class RoleWorker:
    """Runs inside a Ray actor: loads its model from a path and serves one role ('reward', 'critic' or
    'reference'), as its settings' type says."""

    def __init__(self, role: str, model_path: str, settings: RoleWorkerSettings):
        torch.set_num_threads(1)  # an actor beside others on the node's cores: one thread, as the trainer runs
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.role, self.settings = role, settings
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if role == "reference":
            self._load_reference(model_path, settings)
            return
        if role == "reward":
            model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1).to(self.device)
            self.tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path or model_path)
            model.config.pad_token_id = self.tokenizer.pad_token_id  # pooling at the last non-pad token, as TRL
            model.eval()
            self.model = model
        else:
            from ..critic.updater import CriticUpdater, load_critic

            critic = load_critic(model_path, settings.seed).to(self.device)
            # Replicated until the group's process group exists (`init_process_group`): FSDP2 shards over it.
            self.updater = CriticUpdater(critic, settings.updater)
            self.sharding = settings.sharding

    def _load_reference(self, model_path: str, settings: ReferenceWorkerSettings) -> None:
        """The frozen reference policy, scored as TRL scores its `ref_model`: its fused log-prob head (and
        trl-scale's packed scoring when the trainer packs)."""
        from transformers import AutoModelForCausalLM
        from trl.trainer.utils import add_fused_lm_head

        from ..scoring import install_packed_scoring

        dtype = settings.dtype
        dtype = getattr(torch, dtype) if dtype not in (None, "auto") else dtype
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=dtype, attn_implementation=settings.attn_implementation
        ).to(self.device)
        model.eval()
        scoring = settings.scoring  # the trainer's ScoringSettings: scored as the policy is
        add_fused_lm_head(model, temperature=scoring.temperature, cast_lm_head_to_fp32=scoring.cast_lm_head_to_fp32)
        install_packed_scoring(model, scoring)
        self.autocast_dtype = getattr(torch, settings.autocast_dtype) if settings.autocast_dtype else None
        self.model = model

    def ping(self) -> str:
        return self.role

    def rendezvous_address(self) -> tuple[str, int]:
        import ray

        from ..net import free_port

        return ray.util.get_node_ip_address(), free_port()

    def init_process_group(self, rank: int, world_size: int, address: str, port: int) -> None:
        """Join the group's own process group and start from rank 0's weights."""
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size)
        with torch.no_grad():
            for parameter in self.updater.critic.parameters():
                dist.broadcast(parameter.data, src=0)
        if self.sharding != "replicated":
            from ..critic.updater import CriticUpdater

            self.updater = CriticUpdater(self.updater.critic, self.settings.updater, sharding=self.sharding)

    @torch.no_grad()
    def rewards(self, texts: list[str]) -> list[float]:
        if not texts:  # more workers than texts
            return []
        inputs = self.tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        ).to(self.device)
        return self.model(**inputs).logits[:, 0].float().cpu().tolist()

    @torch.no_grad()
    def logps(self, pieces: list[RoleRows]) -> list[torch.Tensor]:
        """Per-token log-probs of each row's last ``num_tokens`` tokens, as TRL's `_get_per_token_logps...`."""
        out = []
        for piece in pieces:
            if piece.rows.num_rows == 0:  # more workers than rows
                out.append(torch.zeros(0, piece.num_tokens))
                continue
            input_ids, attention_mask = piece.rows.to_padded(device=self.device)
            labels = input_ids.masked_fill(attention_mask == 0, -100)
            labels[:, : -piece.num_tokens] = -100
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                output = self.model(
                    input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True
                )
            out.append(output.log_probs[:, -piece.num_tokens :].float().cpu())
        return out

    def values(self, pieces: list[RoleRows]) -> list[torch.Tensor]:
        out = []
        for piece in pieces:
            input_ids, attention_mask = piece.rows.to_padded(device=self.device)
            out.append(self.updater.values(input_ids, attention_mask, piece.prompt_len, piece.num_tokens).cpu())
        return out

    def step(self, pieces: list[RoleRows], train: bool) -> list[tuple[torch.Tensor, dict]]:
        """One micro-step of the critic over every piece (one per trainer rank): backward on each, then a single
        optimizer step at the end of the accumulation window."""
        results = []
        for piece in pieces:
            input_ids, attention_mask = piece.rows.to_padded(device=self.device)
            old_values, returns, mask = (t.to(self.device) for t in (piece.old_values, piece.returns, piece.mask))
            loss, stats = self.updater.loss_and_backward(
                input_ids,
                attention_mask,
                piece.prompt_len,
                old_values,
                returns,
                mask,
                train=train,
                loss_scale=piece.loss_scale,
            )
            results.append((loss.cpu(), {k: v.cpu() for k, v in stats.items()}))
        if train:
            self.updater.end_micro_step()
        return results

    def set_scheduler(self, *args):
        self.updater.set_scheduler(*args)

    def state(self, with_weights: bool = True):
        return self.updater.state(with_weights)

    def shard_bytes(self) -> dict[str, int]:
        return self.updater.shard_bytes()

    def load_state(self, state):
        self.updater.load_state(state)
