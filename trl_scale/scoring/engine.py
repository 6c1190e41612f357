"""The packed scoring engine: one wrapper around a model's TRL fused forward that every trainer uses.

TRL calls every scoring path (policy, old and reference log-probs, DPO's chosen/rejected, the loss) as
``model(input_ids[B, T], attention_mask[B, T], labels=..., fused_lm_head=True)`` and reads per-token fields of
shape ``[B, T-1]``. :func:`install_packed_scoring` wraps that forward: it packs the real tokens into
micro-batches (:mod:`.packing`), runs the backbone with ``attention_mask=None`` and no cache, scores only
labelled tokens with the chunked head (:mod:`.logprob_head`), and scatters the fields back to ``[B, T-1]``,
so TRL's loss code, normalisation and metrics run unchanged. Calls it cannot pack exactly (pre-shifted labels,
caller ``position_ids``, embeddings, multimodal or MoE-router kwargs) go to TRL's forward untouched, and so does
every call on a model where packing is not exact (:mod:`.support` probes each model once).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from contextlib import nullcontext

import torch
import torch.distributed as dist

from .image_packing import image_pieces, packs_images
from .logprob_head import chunked_logprobs, gathered_lm_head, logit_transform_of
from .packing import empty_forward_anchor, pack_padded_batch, packed_forward_kwargs, unpack
from .router_loss import asks_router_logits, with_router_loss
from .routing_replay import packed_layout
from .sampler_support import kept_log_mass
from .sequence_parallel import SequenceParallelGroup, check_same_batch, summed_over_group
from .settings import PackedScoringConfig, PackingStats, ScoringSettings
from .support import packing_support, use_packing
from .tree_flex import static_shapes
from .tree_forward import TreeMicroBatch, planned_trees, tree_backbone_forward
from .varlen import install_varlen_attention, uninstall_varlen_attention, varlen_forward

# Keyword arguments a packable call may carry besides input_ids/attention_mask/labels.
_PACKABLE_KWARGS = {"use_cache", "return_dict"}
# A vision-language model's image inputs as TRL's trainers pass them to a scoring call: such a call runs padded (its
# images stay with their rows), its log-probs from the chunked head (`padded_fused_forward`).
IMAGE_KWARGS = frozenset({"pixel_values", "token_type_ids", "mm_token_type_ids", "image_grid_thw"})
IMAGE_KWARGS |= {"pixel_attention_mask", "image_sizes", "image_position_ids"}


def _same_count_on_every_rank(count: int, device: torch.device) -> int:
    """Every data-parallel rank must run the same number of backbone forwards (sharded parameters are gathered
    collectively per forward under ZeRO-3/FSDP), so take the maximum across ranks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return count
    backend_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor([count], device=backend_device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def _packed_on_every_rank(input_ids, attention_mask, token_budget: int | None, row_capacity):
    """The batch packed into as many micro-batches as the rank that needs most (see `_same_count_on_every_rank`)."""
    packed = pack_padded_batch(input_ids, attention_mask, token_budget, row_capacity=row_capacity)
    count = _same_count_on_every_rank(len(packed.micro_batches), input_ids.device)
    if count != len(packed.micro_batches):
        packed = pack_padded_batch(input_ids, attention_mask, token_budget, count, row_capacity=row_capacity)
    return packed


def packed_backbone_forward(
    backbone, input_ids, attention_mask, token_budget: int | None, router_logits: list | None = None
):
    """Pack a padded batch and run the backbone on each micro-batch, the same number of forwards on every rank.

    The layout follows the backbone's kernels (:func:`.support.uses_one_row`): one row per micro-batch for varlen
    kernels (with its boundaries) and flex attention, rows as wide as the longest sequence for sdpa and eager. Returns
    ``(packed, [(micro_batch, hidden [n, H]), ...], anchor)``. ``anchor`` is a zero that depends on a dummy forward
    run for an empty micro-batch (a rank with fewer sequences than others); add it to an output so that forward
    takes part in backward, as the collectives of sharded parameters require. ``router_logits`` (a list): an MoE
    backbone's router logits are asked for, and each micro-batch's, per layer at its real tokens (``[n, experts]``),
    appended to it.
    """
    support = packing_support(backbone, probe=False)
    varlen = support.varlen
    packed = _packed_on_every_rank(input_ids, attention_mask, token_budget, None if support.one_row else "longest")
    outputs, anchor = [], None
    for micro_batch in packed.micro_batches:
        if micro_batch.input_ids.numel() == 0:
            anchor = empty_forward_anchor(backbone, input_ids.device)
            continue
        kwargs = packed_forward_kwargs(micro_batch, varlen, support.mrope)
        if router_logits is not None:
            kwargs["output_router_logits"] = True
        with varlen_forward() if varlen else _flex_context(backbone, input_ids.device), packed_layout(micro_batch):
            output = backbone(**kwargs)
        outputs.append((micro_batch, micro_batch.real_tokens(output.last_hidden_state)))
        if router_logits is not None:  # each layer's [rows * width, experts], filler included: the real tokens'
            rows, width = micro_batch.input_ids.shape
            layers = output.router_logits
            router_logits.append([micro_batch.real_tokens(layer.reshape(rows, width, -1)) for layer in layers])
    return packed, outputs, anchor


def _flex_context(backbone, device: torch.device):
    """Packed rows on flex attention on CPU compile with static shapes: inductor's CPU flex template fails to build
    the symbolic-length kernel transformers' automatic dynamic shapes recompile to at a second length (TRL's padded
    rows compile another kernel, which builds). Elsewhere, as transformers compiles it."""
    if device.type == "cpu" and getattr(backbone.config, "_attn_implementation", None) == "flex_attention":
        return static_shapes()
    return nullcontext()


def sequence_parallel_backbone_forward(
    backbone, input_ids, attention_mask, token_budget: int | None, sp: SequenceParallelGroup
):
    """:func:`packed_backbone_forward` under Ulysses sequence parallelism: every rank of the SP group holds the same
    batch, packs it the same way (one row per micro-batch, several sequences back to back), and runs the backbone
    on its slice of each row, padded to a multiple of the group's size with filler (a sequence of its own, never
    scored). Returns ``(packed, [(this rank's tokens' flat index, their hidden [n, H]), ...], anchor)``; ``anchor``
    is a zero that depends on every forward (a slice with no token still takes part in backward)."""
    packed = _packed_on_every_rank(input_ids, attention_mask, token_budget, None)
    outputs, anchor = [], None
    for micro_batch in packed.micro_batches:
        width = micro_batch.input_ids.size(1)
        padded, start, end = sp.shard(max(width, 1))
        ids = input_ids.new_zeros((1, padded))
        positions = torch.arange(padded, device=input_ids.device).unsqueeze(0) - width  # filler restarts at 0
        ids[:, :width] = micro_batch.input_ids
        positions[:, :width] = micro_batch.position_ids
        hidden = backbone(
            input_ids=ids[:, start:end], position_ids=positions[:, start:end], attention_mask=None, use_cache=False
        ).last_hidden_state[0]
        anchor = hidden.sum() * 0.0 if anchor is None else anchor + hidden.sum() * 0.0
        mine, rows = slice_tokens(micro_batch.token_index, start, end)
        outputs.append((micro_batch.flat_index[mine], hidden[rows]))
    return packed, outputs, anchor


def slice_tokens(token_index: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The real tokens (positions ``token_index`` in the packed row) that fall in this rank's slice ``[start,
    end)``: a mask over them, and their rows in the slice's hidden states. Each token on exactly one rank."""
    mine = (token_index >= start) & (token_index < end)
    return mine, token_index[mine] - start


def _sharding(sp: SequenceParallelGroup | None) -> SequenceParallelGroup | None:
    """The SP group when it shards anything (more than one rank), else None."""
    return sp if sp is not None and sp.size > 1 else None


def _forward_pieces(
    backbone,
    input_ids,
    attention_mask,
    settings: ScoringSettings,
    sp,
    keep=None,
    *also_same: torch.Tensor,
    router_logits: list | None = None,
) -> tuple[list, torch.Tensor | None, dict[str, int]]:
    """The packed backbone forward of a padded batch: as tree rows where :func:`.tree_forward.planned_trees` says
    so (not under sequence parallelism), else packed rows, sharded over the SP group `sp` when there is one (every
    rank of the group holds the same batch, checked with `also_same`, and runs its slice of each packed row).
    Returns ``([(flat index into [B, T], hidden [n, H]), ...], anchor, figures)``; `keep` ([B * T] bool) may
    leave out positions the caller will not read (tree rows gather only those). `router_logits`: see
    :func:`packed_backbone_forward` (packed rows only: the caller never asks under sequence parallelism, and tree rows
    are not planned for such a call)."""
    real_tokens = int(attention_mask.sum())
    if sp is not None:
        check_same_batch(sp, input_ids, attention_mask, *also_same)
        packed, pieces, anchor = sequence_parallel_backbone_forward(
            backbone, input_ids, attention_mask, settings.token_budget, sp
        )
        forwarded = sum(sp.shard(max(1, micro_batch.input_ids.size(1)))[0] for micro_batch in packed.micro_batches)
        figures = {"real": real_tokens, "forwarded": forwarded, "micro_batches": len(packed.micro_batches)}
        return pieces, anchor, figures | {"sizes": [index.numel() for index, _ in pieces]}
    trees = None
    if router_logits is None:
        trees = planned_trees(backbone, input_ids, attention_mask, settings.token_budget, settings.tree_packing)
    if trees is not None:
        count = _same_count_on_every_rank(len(trees), input_ids.device)
        trees += [TreeMicroBatch(None, [], []) for _ in range(count - len(trees))]
        pieces, anchor = tree_backbone_forward(backbone, trees, input_ids.size(1), keep)
        sizes = [micro_batch.tree.num_tokens for micro_batch in trees if micro_batch.tree is not None]
        figures = {"real": real_tokens, "forwarded": sum(sizes), "micro_batches": count, "tree_tokens": sum(sizes)}
        return pieces, anchor, figures | {"sizes": sizes}
    packed, outputs, anchor = packed_backbone_forward(
        backbone, input_ids, attention_mask, settings.token_budget, router_logits
    )
    pieces = [(micro_batch.flat_index, hidden) for micro_batch, hidden in outputs]
    figures = {"real": real_tokens, "forwarded": packed.forwarded_tokens, "micro_batches": len(packed.micro_batches)}
    return pieces, anchor, figures | {"sizes": [index.numel() for index, _ in pieces]}


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """Each position's label: TRL scores hidden[:, t] against labels[:, t + 1], so in the padded layout a position's
    label is the next column's (the last column has none)."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.size(0), 1), -100)], dim=1)


def packed_fused_forward(
    model,
    config: PackedScoringConfig,
    input_ids,
    attention_mask,
    labels,
    num_items_in_batch,
    router_loss: bool = False,
):
    """The packed equivalent of TRL's ``_fused_forward`` for a padded batch; returns a ``FusedCausalLMOutput``.
    Under sequence parallelism the head's results are summed over the group, so every rank returns the whole
    batch's fields (the group is one data-parallel rank, see :mod:`trl_scale.sharding.data_parallel`).
    `router_loss` (an MoE policy, TRL asking for its router's logits; packed rows, never sharded): the router's
    load-balancing loss over the real tokens, added as TRL adds it (:mod:`.router_loss`)."""
    sp = _sharding(config.sequence_parallel)
    batch_size, seq_len = input_ids.shape
    shift_labels = _shifted(labels)
    keep = (shift_labels != -100).reshape(-1)
    routes: list | None = [] if router_loss else None
    pieces, anchor, figures = _forward_pieces(
        model.base_model, input_ids, attention_mask, config.settings, sp, keep, labels, router_logits=routes
    )
    config.stats.record(batch_size * seq_len, figures)
    output = _scored_output(model, config, pieces, shift_labels, anchor, num_items_in_batch, sp=sp)
    return with_router_loss(model, output, routes) if router_loss else output


def padded_fused_forward(
    model, config: PackedScoringConfig, input_ids, attention_mask, labels, num_items_in_batch, images=None
):
    """TRL's padded forward (the backbone as TRL calls it), scored by the chunked head (only the labelled tokens,
    with the settings' sampler support): the calls packing cannot take, when log-probs must be on the sampler's
    support, and calls with `images` (their inputs, `IMAGE_KWARGS`), whose prompts are long and never scored."""
    batch_size, seq_len = input_ids.shape
    shift_labels = _shifted(labels)
    backbone = model.base_model
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **(images or {}))
    hidden = hidden.last_hidden_state
    flat_index = torch.arange(batch_size * seq_len, device=input_ids.device)
    pieces = [(flat_index, hidden.reshape(batch_size * seq_len, -1))]
    return _scored_output(model, config, pieces, shift_labels, None, num_items_in_batch)


def packed_image_forward(model, config: PackedScoringConfig, input_ids, attention_mask, labels, num_items, images):
    """A call with images as packed rows (`image_packing`: the images stay with their sequences, the padding goes),
    scored by the chunked head."""
    pieces = image_pieces(model.base_model, input_ids, attention_mask, images)
    return _scored_output(model, config, pieces, _shifted(labels), None, num_items)


def _scored_output(
    model,
    config: PackedScoringConfig,
    pieces,
    shift_labels,
    anchor,
    num_items_in_batch,
    sp: SequenceParallelGroup | None = None,
):
    """Score the labelled tokens of ``pieces`` (``(flat index into [B, T], hidden [n, H])``) with the chunked head
    and lay the fields out as TRL's fused forward returns them (``[B, T-1]``). Under sequence parallelism each rank
    scored its own tokens: the fields are summed over the group, so every rank holds all of them."""
    from trl.trainer.utils import FusedCausalLMOutput

    settings = config.settings
    softcap, logit_scale = logit_transform_of(model.config)
    lm_head = model.get_output_embeddings()
    # TRL's head options: the fp32 head runs on upcast hidden states outside autocast (`cast_lm_head_to_fp32`).
    head_autocast = nullcontext()
    if settings.cast_lm_head_to_fp32:
        head_autocast = torch.autocast(lm_head.weight.device.type, enabled=False)

    names = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    collected: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    indices: list[torch.Tensor] = []
    with gathered_lm_head(lm_head) as (weight, bias), head_autocast:
        for flat_index, hidden in pieces:
            targets = shift_labels.reshape(-1)[flat_index]
            scored = targets != -100
            if not scored.any():
                anchor = hidden.sum() * 0.0 if anchor is None else anchor + hidden.sum() * 0.0
                continue
            hidden = hidden[scored].to(weight.device)
            if settings.cast_lm_head_to_fp32:
                hidden = hidden.float()
            head = (settings.temperature, settings.logprob_chunk_size, softcap, logit_scale)
            per_token = list(chunked_logprobs(hidden, weight, bias, targets[scored], *head, config.outputs))
            if settings.sampler_support is not None:
                mass = kept_log_mass(hidden, weight, bias, targets[scored], settings.sampler_support, *head)
                per_token[0] = per_token[0] - mass.to(per_token[0].dtype)
            for name, value in zip(names, per_token):
                if value is not None:
                    collected[name].append(value)
            indices.append(flat_index[scored])

    empty = weight.new_zeros(0, dtype=torch.float32)
    fields = _laid_out(config.outputs, collected, indices, shift_labels, anchor, sp, empty)
    label_mask = shift_labels[:, :-1] != -100
    denominator = label_mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -fields["log_probs"].sum() / denominator
    return FusedCausalLMOutput(loss=loss, label_mask=label_mask, aux_loss=None, **fields)


def _laid_out(outputs, collected: dict, indices: list, shift_labels, anchor, sp, empty: torch.Tensor) -> dict:
    """The scored tokens' fields (`collected`, at the flat `indices` into [B, T]) laid out as TRL's fused forward
    returns them ([B, T-1]; None for an output not asked for), summed over the sequence-parallel group."""
    batch_size, seq_len = shift_labels.shape
    flat_index = torch.cat(indices) if indices else shift_labels.new_zeros(0)
    fields = {}
    for name, values in collected.items():
        if name != "log_probs" and name not in outputs:
            fields[name] = None
            continue
        values = torch.cat(values) if values else empty
        if name == "is_top1":
            full = torch.zeros(batch_size * seq_len, dtype=torch.float32, device=shift_labels.device)
            full[flat_index] = values.float()
            if sp is not None:
                full = summed_over_group(full, sp)
            fields[name] = full.view(batch_size, seq_len)[:, :-1] > 0.5
        else:
            fields[name] = unpack(values.float(), flat_index, batch_size, seq_len)[:, :-1]
            if sp is not None:
                if anchor is not None:  # before the sum: every rank's slice takes part in backward, scored or not
                    fields[name] = fields[name] + anchor
                fields[name] = summed_over_group(fields[name], sp)
    if anchor is not None and sp is None:
        fields["log_probs"] = fields["log_probs"] + anchor
    return fields


def _is_padded_call(labels, shift_labels, kwargs: dict, with_images: bool = False) -> bool:
    """A scoring call packing can take: padded [batch, seq] ids and mask with labels, nothing else that would
    need a position (no images, embeddings, position_ids or cache). `with_images`: such a call with image inputs
    (`IMAGE_KWARGS`), which the chunked head scores padded."""
    input_ids, attention_mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
    given = {name for name, value in kwargs.items() if value is not None}  # PEFT passes inputs_embeds=None ...
    extra = given - {"input_ids", "attention_mask"} - _PACKABLE_KWARGS
    return (
        labels is not None
        and shift_labels is None
        and isinstance(input_ids, torch.Tensor)
        and input_ids.dim() == 2
        and isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 2
        and (bool(extra) and extra <= IMAGE_KWARGS if with_images else not extra)
        and kwargs.get("use_cache") in (None, False)
    )


def install_packed_scoring(
    model,
    settings: ScoringSettings | None = None,
    outputs: tuple[str, ...] = (),
    stats: PackingStats | None = None,
    sequence_parallel: SequenceParallelGroup | None = None,
    **fields,
) -> PackedScoringConfig | None:
    """Wrap ``model.forward`` (already patched by TRL's ``add_fused_lm_head``) so that packable
    ``fused_lm_head=True`` calls run packed, scored as ``settings`` say (or a `ScoringSettings` of ``fields``, e.g.
    ``token_budget=10``). Returns the live config (its ``stats`` collect padding figures), or None where packing is
    not exact for this text model (TRL's forward stays; see :func:`.support.use_packing`). With
    ``sequence_parallel`` (a group from :func:`.sequence_parallel.enable_sequence_parallel`) every scoring call
    runs packed and sharded over the group; a call it cannot take is an error (TRL's forward would see a slice of
    the attention)."""
    settings = dataclasses.replace(settings or ScoringSettings(), **fields)
    on_support = settings.sampler_support is not None
    sharded = _sharding(sequence_parallel) is not None
    if not sharded and settings.padding_free is not False:
        _varlen_where_exact(model)
    # a vision-language model keeps the wrapper where packing is not exact for it: its calls with images go to the
    # chunked head padded (`padded_fused_forward`), the others to TRL's forward
    takes_images = getattr(model.config, "vision_config", None) is not None
    if (
        not sharded
        and not on_support
        and not takes_images
        and not use_packing(model.base_model, settings.padding_free)
    ):
        if settings.tree_packing is True:
            _refuse_trees_unpacked(model.base_model)
        return None
    config = PackedScoringConfig(settings, tuple(outputs), stats or PackingStats(), sequence_parallel)
    model.forward = types.MethodType(_engine_forward(type(model), config, model.forward), model)
    model._trl_scale_packed_scoring = config
    return config


def _engine_forward(model_class, config: PackedScoringConfig, trl_forward):
    """The forward the engine installs: each `fused_lm_head` call to the path that takes it (sharded, packed rows,
    the chunked head padded on the sampler's support or with images), anything else to TRL's `trl_forward`."""
    sharded = _sharding(config.sequence_parallel) is not None
    on_support = config.settings.sampler_support is not None

    # Keep the class signature: `generate` validates its kwargs against it (as TRL's fused forward does).
    @functools.wraps(model_class.forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        input_ids = kwargs.get("input_ids")
        attention_mask = kwargs.get("attention_mask")
        router_loss = asks_router_logits(self.config, kwargs)  # an MoE policy's router loss, as TRL asks it
        packable = {name: value for name, value in kwargs.items() if name != "output_router_logits"}
        if sharded or config.settings.tree_packing is True:  # (not taken there: TRL's forward, or the refusal)
            packable = kwargs if router_loss else packable
        padded_call = fused_lm_head and not args and _is_padded_call(labels, shift_labels, packable)
        width = input_ids.size(1) if padded_call else 0
        if sharded and fused_lm_head:  # (a plain forward, e.g. generation, runs unsharded: see the trainers)
            if not padded_call:
                raise ValueError(
                    "sequence parallelism scores padded [batch, seq] calls with labels only (no images, embeddings, "
                    "position_ids or cache): this call is not one. Fix: sp_size=1 for this model or trainer"
                )
            return packed_fused_forward(self, config, input_ids, attention_mask, labels, num_items_in_batch)
        if padded_call and use_packing(self.base_model, config.settings.padding_free, probe_now=True, width=width):
            return packed_fused_forward(
                self, config, input_ids, attention_mask, labels, num_items_in_batch, router_loss
            )
        if padded_call and config.settings.tree_packing is True:
            _refuse_trees_unpacked(self.base_model)
        if padded_call and on_support and not router_loss:
            return padded_fused_forward(self, config, input_ids, attention_mask, labels, num_items_in_batch)
        if fused_lm_head and not args and not sharded and _is_padded_call(labels, shift_labels, kwargs, True):
            images = {name: kwargs[name] for name in IMAGE_KWARGS if kwargs.get(name) is not None}
            if images and config.settings.tree_packing is True:
                raise ValueError(TREES_WITH_IMAGES)
            config.stats.image_calls += 1
            if packs_images(self.base_model, images, config.settings.padding_free):
                config.stats.packed_image_calls += 1
                return packed_image_forward(
                    self, config, input_ids, attention_mask, labels, num_items_in_batch, images
                )
            return padded_fused_forward(self, config, input_ids, attention_mask, labels, num_items_in_batch, images)
        if fused_lm_head:
            config.stats.fallbacks += 1
            if on_support:
                _warn_off_support_once()
        return trl_forward(
            *args,
            fused_lm_head=fused_lm_head,
            labels=labels,
            shift_labels=shift_labels,
            num_items_in_batch=num_items_in_batch,
            **kwargs,
        )

    return forward


TREES_WITH_IMAGES = (
    "tree_packing=True, but this scoring call has images: tree rows take text-only calls (a call with images is "
    "scored as packed rows without trees). Fix: tree_packing='auto' (tree rows where a call has no images) or "
    "tree_packing=False"
)


def _refuse_trees_unpacked(backbone) -> None:
    """tree_packing=True on a model whose calls are not packed (packing is not exact for its family): tree rows
    are packed rows, so the setting would act on nothing."""
    support = packing_support(backbone)
    if support.exact is False:
        raise ValueError(
            f"tree_packing=True, but packed scoring is not exact for model type '{support.model_type}' "
            f"({support.reason}), and tree rows are packed rows: nothing would be folded. Fix: tree_packing='auto' "
            "(folds where exact) or tree_packing=False"
        )


def _varlen_where_exact(model) -> None:
    """An sdpa model on CUDA packs into one row for torch's flash varlen kernel (:mod:`.varlen`) where the packing
    probe finds that exact (now, or at the first scoring call under ZeRO-3); a model it is not exact for stays on
    sdpa and its rows."""
    if not install_varlen_attention(model):
        return
    if packing_support(model.base_model).exact is False:
        uninstall_varlen_attention(model)
        del model.base_model._trl_scale_packing_support  # laid out and probed again as sdpa


@functools.cache
def _warn_off_support_once() -> None:
    from ..logs import get_logger

    get_logger(__name__).warning(
        "a scoring call with inputs the chunked head cannot take (precomputed embeddings, position_ids) "
        "went to TRL's forward: its log-probs cover the whole vocabulary, not the sampler's top-k/top-p/min-p "
        "support, so its importance ratios carry the kept mass. Set logprobs_on_sampler_support=False to silence "
        "this, or sample without truncation"
    )
