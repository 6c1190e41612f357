"""How the policy's decoder layers run, as a trainer feature: compiled (`compile_decoder_layers`) and which of them
activation checkpointing recomputes (`gradient_checkpointing_layers`). Set up after packed scoring, whose probe
would otherwise compile its own small shapes."""

from __future__ import annotations

from transformers import TrainerCallback

from ..distributed.roles import RayReference
from ..logs import get_logger
from ..scoring import checkpointing
from ..scoring.compiled import compile_decoder_layers, decoder_layers, why_not_compile
from .feature import Feature, Patch

logger = get_logger(__name__)


def _sharded_by_layer(accelerator) -> str | None:
    """ZeRO-3 or FSDP: parameters gathered layer by layer (neither compile nor the memory plan was measured so)."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.FSDP:
        return "FSDP"
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and getattr(plugin, "zero_stage", 0) == 3:
        return "ZeRO-3"
    return None


class DecoderLayers(Feature):
    """Compiles the policy's and a local reference's decoder layers where `compile_decoder_layers` asks (`None`: at
    the start of training, where `why_not_compile` finds it pays for the planned steps), and plans each training
    forward's checkpointed layers by memory (`gradient_checkpointing_layers="auto"` on CUDA)."""

    name = "decoder_layers"
    PATCHES = (
        Patch(
            "each decoder layer's call (torch.compile)",
            "train begin, where compiling pays (compile_decoder_layers)",
            "never",
            "scoring/compiled.py",
            lambda plan, config: config.compile_decoder_layers is not False,
        ),
    )

    def __init__(self, sequence_parallel_size: int = 1):
        self.sequence_parallel_size = sequence_parallel_size
        self.checkpointing: checkpointing.SelectiveCheckpointing | None = None
        self.compiled = False

    @classmethod
    def build(cls, plan) -> DecoderLayers:
        return cls(plan.scoring.sequence_parallel_size)

    def check(self, run) -> None:
        if run.trl.args.compile_decoder_layers:
            try:
                decoder_layers(run.trl.accelerator.unwrap_model(run.trl.model))
            except ValueError as error:
                raise ValueError(
                    f"compile_decoder_layers=True compiles each decoder layer, but {error}. Fix: "
                    "compile_decoder_layers=None (compiles where it can and pays) or False"
                ) from None

    def setup(self, run) -> None:
        if run.trl.args.compile_decoder_layers:
            self.compile(run.trl)
        elif run.trl.args.compile_decoder_layers is None:
            run.trl.add_callback(_CompileWhenItPays(self, run.trl))
        self.checkpointing = self._plan_checkpointing(run.trl)

    def compile(self, trl) -> None:
        for model in (trl.model, trl.ref_model):
            if model is not None and not isinstance(model, RayReference):
                compile_decoder_layers(trl.accelerator.unwrap_model(model))
        self.compiled = True

    def why_not_compile(self, trl, planned_steps: int) -> str | None:
        from peft import PeftModel

        policy = trl.accelerator.unwrap_model(trl.model)
        if isinstance(policy, PeftModel):
            return "a PEFT adapter (compiled LoRA layers were not measured)"
        sharded = _sharded_by_layer(trl.accelerator)
        if sharded is not None:
            return f"{sharded} gathers parameters layer by layer (not measured compiled)"
        return why_not_compile(policy, planned_steps)

    def _plan_checkpointing(self, trl) -> checkpointing.SelectiveCheckpointing | None:
        args = trl.args
        if not args.gradient_checkpointing or args.gradient_checkpointing_layers != "auto":
            return None
        policy = trl.accelerator.unwrap_model(trl.model)
        memory = checkpointing.device_memory(next(policy.parameters()).device)
        reason, sharded = None, _sharded_by_layer(trl.accelerator)
        if memory is None:
            reason = "not on CUDA"
        elif sharded is not None:
            reason = f"{sharded} gathers parameters layer by layer"
        elif self.sequence_parallel_size > 1:
            reason = "sequence parallelism"
        elif getattr(policy.config, "_attn_implementation", None) == "eager":
            reason = "eager attention keeps activations quadratic in length"
        if reason is None:
            try:
                return checkpointing.SelectiveCheckpointing(policy, memory)
            except ValueError as error:
                reason = str(error)
        logger.info("gradient_checkpointing_layers='auto': every layer checkpointed (%s)", reason)
        return None

    def log(self, run, logs: dict[str, float]) -> None:
        if self.checkpointing is not None and self.checkpointing.last_checkpointed is not None:
            logs["gradient_checkpointing/layers"] = float(self.checkpointing.last_checkpointed)

    def card_tags(self, run) -> list[str]:
        return ["compiled-layers"] if self.compiled else []


class _CompileWhenItPays(TrainerCallback):
    """`compile_decoder_layers=None`: decided when training begins, once the Trainer knows the planned steps."""

    def __init__(self, feature: DecoderLayers, trl):
        self.feature = feature
        self.trl = trl

    def on_train_begin(self, args, state, control, **kwargs):
        if self.feature.compiled:
            return
        reason = self.feature.why_not_compile(self.trl, state.max_steps)
        if reason is None:
            logger.info(
                "compile_decoder_layers=None: compiling the decoder layers (%d steps planned)", state.max_steps
            )
            self.feature.compile(self.trl)
        else:
            logger.info("compile_decoder_layers=None: decoder layers left uncompiled (%s)", reason)
