"""The probe outside a trainer (`trl-scale check-servers URL... --model PATH`): a model loaded here scores what each
server sampled, with a plain forward (the trainer's probe scores through TRL's own method instead)."""

from __future__ import annotations

from .figures import MismatchFigures, mismatch_figures

PROBE_TEXTS = ("one two three", "count to five", "the next number is", "four five six seven")


def probe_prompts(tokenizer) -> list[list[int]]:
    """The probe's prompts, as `tokenizer` encodes them (no special tokens)."""
    return [tokenizer(text, add_special_tokens=False)["input_ids"] or [0] for text in PROBE_TEXTS]


def scored_figures(model, prompts: list[list[int]], samples: dict, temperature: float = 1.0) -> list[MismatchFigures]:
    """Per server of `samples` (`rollout.mismatch_probe.sample_each_server`'s): its figures against `model`."""
    import torch

    figures = []
    for url, per_prompt in samples.items():
        sampler, policy = [], []
        for prompt, choices in zip(prompts, per_prompt, strict=True):
            for ids, logprobs in choices:
                if not ids:
                    continue
                with torch.no_grad():
                    logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
                scored = torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(ids)[:, None])
                sampler.append(logprobs)
                policy.append(scored[:, 0].tolist())
        figures.append(mismatch_figures(url, sampler, policy))
    return figures
