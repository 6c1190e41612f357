"""What runs inside a role group's Ray actors: `RoleWorker`, the base every role's worker builds on (one thread, its
device, the group's process group for a role that needs one), and the reward and reference workers, each loaded from
a path and fed texts or `RoleRows` (token ids without padding). The critic's worker lives with the critic
(`critic/worker.py`). A worker's settings name its class (`worker_class`), so `RoleGroup` starts the right one."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..scoring.packing import UnpaddedRows
from .row_images import RowImages

if TYPE_CHECKING:
    from ..scoring import ScoringSettings


@dataclass(frozen=True)
class RewardWorkerSettings:
    """A reward worker scores texts with the tokenizer TRL would load for that reward model."""

    tokenizer_path: str

    @staticmethod
    def worker_class() -> type:
        return RewardWorker


@dataclass(frozen=True)
class ReferenceWorkerSettings:
    """A reference worker loads the policy's checkpoint as TRL loads its reference (dtype, attention kernel) and
    scores it as the trainer scores the policy (`scoring`: temperature, fp32 head, packing), under the trainer's
    mixed precision (`autocast_dtype`, e.g. "bfloat16")."""

    scoring: ScoringSettings
    dtype: str | None = None
    attn_implementation: str | None = None
    autocast_dtype: str | None = None

    @staticmethod
    def worker_class() -> type:
        return ReferenceWorker


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
    images: RowImages | None = None  # the rows' image inputs (the reference of a vision-language policy)

    def split(self, n: int) -> list[RoleRows]:
        """`n` shards of the rows, each with its rows' images and update tensors."""
        shards = [replace(self, rows=r) for r in self.rows.split(n)]
        if self.images is not None:
            shards = [replace(s, images=i) for s, i in zip(shards, self.images.split(n))]
        if self.mask is None:
            return shards
        parts = zip(shards, self.old_values.tensor_split(n), self.returns.tensor_split(n), self.mask.tensor_split(n))
        return [replace(s, old_values=v, returns=g, mask=m) for s, v, g, m in parts]

    def model_images(self, device: torch.device) -> dict | None:
        """The rows' image inputs for the model's forward, on `device` (None without images)."""
        return self.images.model_inputs(device) if self.images is not None else None


class RoleWorker:
    """Runs inside a Ray actor: one role's model, loaded by the subclass. `stateless`: a dead worker can be replaced
    and the call retried (its model is all it holds); `uses_process_group`: a group of several joins its own process
    group (`rendezvous_address`, then `init_process_group` on each), for a role whose state is sharded."""

    stateless = True
    uses_process_group = False

    def __init__(self, role: str, settings):
        torch.set_num_threads(1)  # an actor beside others on the node's cores: one thread, as the trainer runs
        self.role, self.settings = role, settings
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def ping(self) -> str:
        return self.role

    def rendezvous_address(self) -> tuple[str, int]:
        import ray

        from ..net import free_port

        return ray.util.get_node_ip_address(), free_port()

    def init_process_group(self, rank: int, world_size: int, address: str, port: int) -> None:
        """Join the group's own process group (then `joined_group`)."""
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=world_size)
        self.joined_group()

    def joined_group(self) -> None:
        """What a role does once its group's process group exists (a role with `uses_process_group`)."""


class RewardWorker(RoleWorker):
    """A reward model scoring texts, tokenized as TRL tokenizes for that reward model."""

    def __init__(self, role: str, model_path: str, settings: RewardWorkerSettings):
        super().__init__(role, settings)
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model = AutoModelForSequenceClassification.from_pretrained(model_path, num_labels=1).to(self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path or model_path)
        model.config.pad_token_id = self.tokenizer.pad_token_id  # pooling at the last non-pad token, as TRL
        model.eval()
        self.model = model

    @torch.no_grad()
    def rewards(self, texts: list[str]) -> list[float]:
        if not texts:  # more workers than texts
            return []
        inputs = self.tokenizer(
            text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        ).to(self.device)
        return self.model(**inputs).logits[:, 0].float().cpu().tolist()


class ReferenceWorker(RoleWorker):
    """The frozen reference policy, scored as TRL scores its `ref_model`: its fused log-prob head (and trl-scale's
    packed scoring when the trainer packs), under the trainer's mixed precision."""

    def __init__(self, role: str, model_path: str, settings: ReferenceWorkerSettings):
        super().__init__(role, settings)
        from trl.trainer.utils import add_fused_lm_head, create_model_from_path

        from ..scoring import install_packed_scoring

        dtype = settings.dtype
        dtype = getattr(torch, dtype) if dtype not in (None, "auto") else dtype
        # as TRL builds its reference: the checkpoint's own architecture (a vision-language model's included)
        model = create_model_from_path(model_path, dtype=dtype, attn_implementation=settings.attn_implementation).to(
            self.device
        )
        model.eval()
        scoring = settings.scoring  # the trainer's ScoringSettings: scored as the policy is
        add_fused_lm_head(model, temperature=scoring.temperature, cast_lm_head_to_fp32=scoring.cast_lm_head_to_fp32)
        install_packed_scoring(model, scoring)
        self.autocast_dtype = getattr(torch, settings.autocast_dtype) if settings.autocast_dtype else None
        self.model = model

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
            images = piece.model_images(self.device) or {}
            with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                output = self.model(
                    input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True, **images
                )
            out.append(output.log_probs[:, -piece.num_tokens :].float().cpu())
        return out
