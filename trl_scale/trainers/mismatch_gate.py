"""The mismatch gate as a trainer feature: as the first training batch is built, every rollout server samples
completions of that batch's first prompts (sent beside the batch's own requests), the trainer scores the same tokens
with the policy (TRL's scoring, the packed engine) before the first optimizer step, and a server whose sampler is
further from the policy than `rollout_mismatch_budget` stops the run, is warned of, or leaves the fleet
(`rollout_mismatch_action`; to drop a server, the probe runs before the batch, so none of it comes from that server).
Figures: `trl_scale.mismatch`."""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..logs import get_logger
from ..mismatch import MismatchFigures, format_figures, mismatch_figures, sequence_mismatch_figures, verdict
from ..mismatch.arguments import MismatchSettings
from ..ranks import broadcast_from_main, decide_on_main, gathered
from ..rollout.record import RECORD_KEY
from ..timeline import MISMATCH_COUNTER
from .feature import Feature

logger = get_logger(__name__)

# The probe's completions are cut at this many tokens: enough to measure, a small share of a first step
PROBE_TOKENS = 32


@dataclass
class _Probe:
    """The probe under way: the prompts asked, and (main process) the requests' future."""

    prompt_ids: list
    pool: ThreadPoolExecutor | None
    future: Future | None
    start_seconds: float  # the trainer's own time to start it (tokenizing, submitting)


class MismatchGate(Feature):
    """Server rollout with `rollout_mismatch_budget` set (the default): the probe before the first batch."""

    name = "mismatch_gate"

    def __init__(self, settings: MismatchSettings, text_only: bool = True, environments: bool = False):
        self.settings = settings
        self.environments = environments  # TRL renders each prompt with its row's environment's tools
        self.text_only = text_only  # image prompts need their images on the server: not probed (said once)
        self.probed = False
        self.figures: list[MismatchFigures] = []  # per server, in the fleet's order at the probe
        # the trainer's wait for the probe (starting it, then its samples and their scoring after the first batch
        # generated: the requests themselves run beside the batch's; the sync is TRL's own first one)
        self.seconds = 0.0
        self._logged = False
        self.labels: dict[str, int] = {}  # server URL -> its number in the logs (`rollout/mismatch/server<i>/...`)
        # each server's figures of the newest step that measured it, and the sync whose weights drew its tokens
        self.latest: dict[str, tuple[MismatchFigures, int]] = {}
        self._warned: set[str] = set()  # servers already reported past the budget (by the probe or a step)

    @classmethod
    def build(cls, plan) -> MismatchGate | None:
        settings = plan.mismatch
        if not plan.rollout.server or settings.budget is None:
            return None
        return cls(settings, text_only=not plan.images, environments=plan.rollout.environments)

    def generate_and_score(self, run, proceed, inputs):
        training = run.trl.model.training
        probe = None
        if not self.probed and training:
            self.probed = True
            probe = self._start_probe(run, inputs)
            if probe is not None and self.settings.action == "drop":  # a server to drop must not draw the batch
                self._finish_probe(run, probe)
                probe = None
        try:
            batch = proceed(inputs)
        except Exception as failure:
            _raise_probe_error(probe, failure)
            raise
        finally:
            if probe is not None and probe.pool is not None:
                probe.pool.shutdown(wait=False)
        if probe is not None:  # before the first optimizer step: an error still stops the run before step 1
            self._finish_probe(run, probe)
        if training:
            self._observe(run, batch)
        return batch

    def _observe(self, run, batch: dict) -> None:
        """Every step: each server's figures from the tokens it drew with the weights just synced (the sampler's
        log-probs against TRL's old log-probs of the same tokens, both already computed), checked against the
        budget: a server whose weights a sync did not reach is caught at the step after it. GRPO and PPO keep the
        old log-probs per token; RLOO keeps each completion's sum (`sequence_mismatch_figures`)."""
        if "sampling_per_token_logps" in batch and "old_per_token_logps" in batch:
            per_token = True
        elif "old_logps" in batch:
            per_token = False
        else:
            return  # not measurable (the same on every rank): no sampler log-probs asked for
        now = run.trl.vllm_generation.sync_count
        merged: dict[str, list] = {}
        for per_rank in gathered(_drawn_at(batch, now, per_token)):
            for url, drawn in per_rank.items():
                merged.setdefault(url, []).extend(drawn)
        args, step = run.trl.args, run.trl.state.global_step
        clip_max, clip_min = args.vllm_importance_sampling_clip_max, args.vllm_importance_sampling_clip_min
        timeline = run.clock.timeline
        past: dict[str, str] = {}  # server URL -> its verdict
        for url, drawn in merged.items():
            if per_token:
                if sum(len(sampler) for sampler, _ in drawn) == 0:
                    continue
                figures = mismatch_figures(url, *zip(*drawn), clip_max, clip_min)
            else:
                sampler, policy, lengths = zip(*drawn)
                figures = sequence_mismatch_figures(url, sampler, policy, lengths, clip_max, clip_min)
            self.latest[url] = (figures, now)
            if timeline is not None:
                timeline.counter(url, MISMATCH_COUNTER, time.perf_counter(), kl=figures.kl, step=step, sync=now)
            line = verdict(figures, self.settings.budget)
            if line is not None and url not in self._warned:
                past[url] = f"{line} (at step {step}, weights of sync {now})"
        if past:
            self._act(run.trl.vllm_generation.client, past, _unreplayed_moe(run))

    def _start_probe(self, run, inputs: list) -> _Probe | None:
        """The probe's requests, sent by the main process while the first batch generates (the servers batch them
        with it: the probe's wall time hides behind the batch's); None where nothing can be probed."""
        trl = run.trl
        rows = _first_rows(inputs, self.settings.prompts)
        prompts = [row["prompt"] for row in rows]
        if not self.text_only or not prompts:
            why = "its prompts hold images" if not self.text_only else "its rows hold no prompt"
            logger.warning(f"trl-scale: the mismatch probe was not run ({why}); rollout_mismatch_budget is unchecked")
            return None
        generation = trl.vllm_generation
        if trl.state.global_step != trl.weights_synced_at_step:  # the sync TRL makes first: measured after it
            generation.sync_weights()
            trl.mark_synced()
        started = time.perf_counter()
        if self.environments:  # as TRL renders them in a step: each with its row's environment's tools
            names = [row.get("environment") if trl.multi_environment else None for row in rows]
            prompt_ids = trl.trl_method("_tokenize_prompts")(trl.view(_batch_environments=names), prompts)[0]
        else:
            prompt_ids = trl.tokenize_prompts(prompts)[0]
        sampling = {
            **generation.settings.sampling,
            "max_tokens": min(PROBE_TOKENS, generation.settings.max_completion_length),
        }
        pool = future = None
        if trl.accelerator.is_main_process:
            pool = ThreadPoolExecutor(1, thread_name_prefix="mismatch-probe")
            client, adapter = generation.client, generation.syncer.lora_name
            future = pool.submit(sample_each_server, client, prompt_ids, sampling, adapter)
        return _Probe(prompt_ids, pool, future, time.perf_counter() - started)

    def _finish_probe(self, run, probe: _Probe) -> None:
        """The probe's samples (every rank gets them), scored by the policy, each server's figures against the
        budget."""
        trl = run.trl
        started = time.perf_counter()
        answered = decide_on_main(lambda: probe.future.result())
        samples = {url: drawn for url, drawn in answered.items() if drawn is not None}
        unanswered = [url for url, drawn in answered.items() if drawn is None]
        if unanswered and trl.accelerator.is_main_process:
            logger.warning(
                f"trl-scale: the mismatch probe could not reach {unanswered} (the connection failed); each is "
                "measured at the first step it draws tokens in, against the same budget"
            )
        self.figures = self._measured(run, probe.prompt_ids, samples) if samples else []
        for figures in self.figures:
            self._label(figures.server)  # numbered in the fleet's order
        self.seconds = probe.start_seconds + time.perf_counter() - started  # what the trainer waited for it
        past = broadcast_from_main(
            {f.server: line for f in self.figures if (line := verdict(f, self.settings.budget)) is not None}
        )
        if trl.accelerator.is_main_process:
            logger.info("trl-scale mismatch probe (before step 1):\n" + format_figures(self.figures))
        if past:
            self._act(trl.vllm_generation.client, past, _unreplayed_moe(run))

    def _measured(self, run, prompt_ids: list, samples: dict) -> list[MismatchFigures]:
        """Each server's figures: its samples scored by the policy in one call (and by the base model, LoRA)."""
        import torch
        from accelerate.utils import is_peft_model

        trl = run.trl
        rows = [
            (list(prompt_ids[p]), ids, logprobs, url)
            for url, per_prompt in samples.items()
            for p, choices in enumerate(per_prompt)
            for ids, logprobs in choices
        ]
        pad = trl.tokenizer.pad_token_id or 0
        width_prompt = max(len(r[0]) for r in rows)
        width = max(1, max(len(r[1]) for r in rows))
        input_ids = torch.full((len(rows), width_prompt + width), pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, (prompt, ids, _, _) in enumerate(rows):
            input_ids[i, width_prompt - len(prompt) : width_prompt] = torch.tensor(prompt)
            input_ids[i, width_prompt : width_prompt + len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[i, width_prompt - len(prompt) : width_prompt + len(ids)] = 1
        device = trl.accelerator.device
        policy = trl.policy_logps(input_ids.to(device), mask.to(device), width).float().cpu()
        base = None
        if is_peft_model(trl.accelerator.unwrap_model(trl.model)):
            base = trl.policy_logps(input_ids.to(device), mask.to(device), width, base=True).float().cpu()
        args = trl.args
        clip_max, clip_min = args.vllm_importance_sampling_clip_max, args.vllm_importance_sampling_clip_min
        figures = []
        for url in samples:
            own = [i for i, row in enumerate(rows) if row[3] == url]
            sampler = [rows[i][2] for i in own]
            scored = [policy[i, : len(rows[i][1])].tolist() for i in own]
            base_scored = [base[i, : len(rows[i][1])].tolist() for i in own] if base is not None else None
            figures.append(mismatch_figures(url, sampler, scored, clip_max, clip_min, base_scored))
        return figures

    def _act(self, client, past: dict[str, str], unreplayed_moe: bool = False) -> None:
        """`past`: each server past the budget -> its verdict. Each is said (or dropped) once in the run.
        `unreplayed_moe`: the policy is a mixture of experts whose routes are not replayed."""
        self._warned.update(past)
        action, listed = self.settings.action, "\n  - ".join(past.values())
        if unreplayed_moe:  # a sampler in another precision routes some tokens elsewhere: a heavy tail on few tokens
            listed += (
                "\n  (the policy is a mixture of experts: a sampler in another precision routes some tokens to "
                "other experts, which gives a small mean with a heavy tail; routing_replay=True trains on the "
                "sampler's experts)"
            )
        if action == "error" or (action == "drop" and len(past) >= len(client.servers)):
            left = "" if action == "error" else " (rollout_mismatch_action='drop', and no server would be left)"
            raise ValueError(
                f"the rollout servers' samplers are not the policy{left}:\n  - {listed}\nFix: start each named "
                "server with the policy's model, revision, tokenizer and dtype; or raise rollout_mismatch_budget, or "
                "rollout_mismatch_action='warn' / 'drop'"
            )
        if action == "drop":
            for url in past:
                client.retire(url)
            logger.warning(
                f"trl-scale: rollout servers dropped from the fleet (rollout_mismatch_action='drop'):\n  - {listed}"
            )
        else:
            logger.warning(
                f"trl-scale: rollout servers past rollout_mismatch_budget (training goes on):\n  - {listed}"
            )

    def log(self, run, logs: dict[str, float]) -> None:
        if self.figures and not self._logged:  # the probe's figures, in the first training log
            self._logged = True
            for figures in self.figures:
                logs.update(figures.as_logs(f"rollout/mismatch_probe/{self._label(figures.server)}"))
            logs["rollout/mismatch_probe/seconds"] = self.seconds
        for url, (figures, sync) in self.latest.items():  # the newest step's, per server, and the weights it drew with
            prefix = f"rollout/mismatch/{self._label(url)}"
            logs.update(figures.as_logs(prefix))
            logs[f"{prefix}/weights_version"] = float(sync)
        self.latest = {}

    def _label(self, url: str) -> str:
        return f"server{self.labels.setdefault(url, len(self.labels))}"


def _unreplayed_moe(run) -> bool:
    """The policy routes tokens to experts (its config's `num_experts_per_tok`) and `routing_replay` is off."""
    config = run.trl.accelerator.unwrap_model(run.trl.model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "num_experts_per_tok", None) is not None and not run.plan.routing_replay


def _drawn_at(batch: dict, now: int, per_token: bool) -> dict[str, list]:
    """Per server URL, this rank's completions drawn whole with the weights of sync `now` (older ones are
    staleness, not the server's mismatch): (sampler, policy) per-token log-prob lists, or (sampler sum, policy sum,
    tokens) where only sums are kept. Empty where this rank's record does not pair with its batch."""
    record = batch.get(RECORD_KEY)
    mask = batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch else batch["completion_mask"]
    if record is None or len(record.servers) != mask.size(0):
        return {}
    if not per_token and len(record.sampler_logprobs) != mask.size(0):
        return {}
    drawn: dict[str, list] = {}
    for i, (url, (first, _)) in enumerate(zip(record.servers, record.version_spans)):
        if url is None or first != now:
            continue
        kept = mask[i].bool()
        if per_token:
            sampler = batch["sampling_per_token_logps"][i][kept].float().tolist()
            drawn.setdefault(url, []).append((sampler, batch["old_per_token_logps"][i][kept].float().tolist()))
            continue
        length = int(kept.sum())
        sampler = record.sampler_logprobs[i][:length]
        if length and len(sampler) == length and not any(math.isnan(value) for value in sampler):
            drawn.setdefault(url, []).append((sum(sampler), float(batch["old_logps"][i]), length))
    return drawn


def _raise_probe_error(probe: _Probe | None, failure: Exception) -> None:
    """The first batch failed while the probe ran beside it: where the probe failed too, its error names the server
    and the cause (an adapter not loaded leaves no server to generate on: the batch only says none answered), so it
    is raised, with the batch's as its context. Main process only, no collective: the batch's failure is the main
    process's own."""
    if probe is None or probe.future is None:
        return
    try:
        cause = probe.future.exception()
    except Exception:  # cancelled
        return
    if cause is not None:
        raise cause from failure


def _first_rows(inputs: list, count: int) -> list[dict]:
    """The rows of the first `count` distinct prompts of a batch (a group's copies are one)."""
    rows: list[dict] = []
    for row in inputs:
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if prompt is not None and all(prompt != kept["prompt"] for kept in rows):
            rows.append(row)
        if len(rows) == count:
            break
    return rows


def sample_each_server(client, prompt_ids, sampling, model):
    from ..rollout.mismatch_probe import sample_each_server as sampled

    return sampled(client, [list(ids) for ids in prompt_ids], sampling, model)
