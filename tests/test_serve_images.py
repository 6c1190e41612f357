"""`trl-scale serve` of a vision-language model (issue 62): it starts, and TRL's own vLLM client renders a prompt's
images once and generates from token ids paired with those features, as against vLLM with `--enable-scale-out`;
the sampler's log-probs are the policy's with the images (<= 1e-4); bad images are refused naming them."""

from __future__ import annotations

import pytest
import requests
import torch
from PIL import Image
from transformers import AutoTokenizer

import trl_scale

from .helpers import cpu_args, start_servers, step_logs
from .test_ppo_images import _image_prompts, _length_reward


@pytest.fixture(scope="module")
def vlm_server(tiny_vlm):
    (server,) = start_servers(tiny_vlm, 1)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tool_vlm(tmp_path_factory) -> str:
    """The tiny Gemma 3 taught to call `tick` (`toy.tools.build_tool_calling_vlm`), with a full-attention layer: a
    later turn's tokens, past the sliding window of 8, still see the images."""
    from trl_scale.toy import build_tiny_vlm
    from trl_scale.toy.tools import build_tool_calling_vlm

    root = tmp_path_factory.mktemp("tool-vlm")
    base = build_tiny_vlm(root / "vlm", layer_types=["sliding_attention", "full_attention"])
    return build_tool_calling_vlm(base, str(root / "tool-vlm"))


# The tiny model's answers are random tokens, and one may be its image token (1 in 433): trl-scale's client draws
# such an answer again (test_an_answer_holding_an_image_token_is_drawn_again), where TRL's step would
# stop ("Image features and image tokens do not match"). Requests are seeded (each its own seed, the same in every
# run), so the answers are the same on every run; the runs below other than that test's hold none.
SEEDED_REQUESTS = True


def _image(colour: tuple[int, int, int], size: int = 28) -> Image.Image:
    image = Image.new("RGB", (size, size), (255, 255, 255))
    for x in range(4, 12):
        for y in range(4, 12):
            image.putpixel((x, y), colour)
    return image


def _trl_client(url: str, monkeypatch):
    """TRL 1.16's own client (it checks that vLLM is importable, which only its NCCL sync needs)."""
    from trl.generation import vllm_client

    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda: True)
    return vllm_client.VLLMClient(base_url=url)


def _prompt_ids(processor, images) -> list[int]:
    content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": "count"}]
    encoded = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"][0])


def _policy_logprobs(model, processor, prompt: list[int], images, completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    pixel_values = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    token_type_ids = (ids == processor.tokenizer.image_token_id).long()
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixel_values, token_type_ids=token_type_ids).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1).tolist()


def test_trls_client_renders_images_once_and_generates_from_features(tiny_vlm, vlm_server, monkeypatch):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    client = _trl_client(vlm_server.url, monkeypatch)
    processor = AutoProcessor.from_pretrained(tiny_vlm)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm).eval()
    images = [[_image((255, 0, 0))], [_image((0, 0, 255)), _image((0, 255, 0), size=40)]]  # one, then two images
    features = client.image_features(images)
    assert [len(f["mm_placeholders"]["image"]) for f in features] == [1, 2]
    prompts = [_prompt_ids(processor, row) for row in images]
    out = client.generate(prompts, features, n=2, max_tokens=5, logprobs=0, generation_kwargs={"seed": 7})
    assert len(out["completion_ids"]) == 4 and out["prompt_ids"] == prompts
    for row, (completion, logprobs) in enumerate(zip(out["completion_ids"], out["logprobs"])):
        prompt = prompts[row // 2]
        policy = _policy_logprobs(model, processor, prompt, images[row // 2], completion)
        assert max(abs(lp[0] - p) for lp, p in zip(logprobs, policy)) <= 1e-4, row
    again = client.generate(prompts, features, n=2, max_tokens=5, logprobs=0, generation_kwargs={"seed": 7})
    assert again["completion_ids"] == out["completion_ids"]  # a seeded request draws the same numbers
    # a prompt paired with another prompt's features is refused, not generated with the wrong images
    with pytest.raises(Exception, match="1 runs of image tokens but the features carry 2 images"):
        client.generate(prompts[:1], features[1:], n=1, max_tokens=2)


def test_images_the_server_cannot_take_are_refused_naming_them(tiny_vlm, vlm_server, tiny_llama):
    url = vlm_server.url
    render = f"{url}/v1/chat/completions/render"
    fetched = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
    answer = requests.post(render, json={"messages": [{"role": "user", "content": [fetched]}]}, timeout=30)
    assert answer.status_code == 400 and "image 0" in answer.text and "data:image" in answer.text
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}
    answer = requests.post(render, json={"messages": [{"role": "user", "content": [broken]}]}, timeout=30)
    assert answer.status_code == 400 and "cannot be read" in answer.text
    # ids with no image tokens, paired with an image's features: refused, not generated from the text alone
    good = requests.post(
        render,
        json={"messages": [{"role": "user", "content": [_data_url_part(_image((1, 2, 3)))]}]},
        timeout=30,
    ).json()["features"]
    image_token = AutoTokenizer.from_pretrained(tiny_vlm).image_token_id
    text = [t for t in range(5, 20) if t != image_token][:3]
    body = {"token_ids": text, "features": good, "sampling_params": {"max_tokens": 2}}
    answer = requests.post(f"{url}/inference/v1/generate", json=body, timeout=30)
    assert answer.status_code == 400 and "0 runs of image tokens but the features carry 1 images" in answer.text
    body["token_ids"] = text + [image_token] + text  # one image token where the image takes 4
    answer = requests.post(f"{url}/inference/v1/generate", json=body, timeout=30)
    assert answer.status_code == 400 and "runs of image tokens are [1] long, but the images take [4]" in answer.text

    (text_server,) = start_servers(tiny_llama, 1)
    try:
        part = _data_url_part(_image((1, 2, 3)))
        answer = requests.post(
            f"{text_server.url}/v1/chat/completions/render",
            json={"messages": [{"role": "user", "content": [part]}]},
            timeout=30,
        )
        assert answer.status_code == 400 and "takes no images" in answer.text
    finally:
        text_server.stop()


def _data_url_part(image) -> dict:
    from trl.generation.vllm_client import pil_to_base64

    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{pil_to_base64(image)}"}}


def _server_run(
    tiny_vlm, tmp_path, servers, method="grpo", reward=_length_reward, dataset=None, agents=None, **overrides
):
    """A trainer with images over `servers` (trl-scale serve), requests seeded (see SEEDED_REQUESTS); `agents`: the
    trainer's `tools` or `rollout_func`."""
    from transformers import AutoProcessor

    trainer_cls, config_cls = {
        "grpo": (trl_scale.GRPOTrainer, trl_scale.GRPOConfig),
        "rloo": (trl_scale.RLOOTrainer, trl_scale.RLOOConfig),
    }[method]
    settings = dict(
        per_device_train_batch_size=4, num_generations=2, max_completion_length=6, use_vllm=True, vllm_mode="server",
        vllm_server_base_urls=[s.url for s in servers], rollout_request_timeout=60, weight_sync_timeout=60,
    ) | overrides  # fmt: skip
    return trainer_cls(
        model=tiny_vlm,
        reward_funcs=reward,
        args=config_cls(**cpu_args(tmp_path, **settings)),
        train_dataset=dataset if dataset is not None else _image_prompts(16),
        processing_class=AutoProcessor.from_pretrained(tiny_vlm),
        **(agents or {}),
    )


def _sampling_gaps(trainer) -> list[float]:
    """Per step, TRL's largest gap between the sampler's log-probs and the policy's."""
    key = "sampling/sampling_logp_difference/max"
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def _recorded_renders(generation) -> list[tuple[int, int]]:
    """Each render the client asks for from now on, as (its row, how many images it carries)."""
    renders, render = [], generation.client.render
    generation.client.render = lambda images, row: renders.append((row, len(images))) or render(images, row)
    return renders


@pytest.mark.parametrize("method", ["grpo", "rloo"])
def test_a_vision_language_policy_trains_over_two_servers(tiny_vlm, method, tmp_path):
    """GRPO and RLOO with images over two `trl-scale serve` servers through trl-scale's client (synchronous): each
    prompt's image rendered once and paired with its G completions' request, the servers' weights synced every step,
    and the sampler's log-probs the policy's (images included), within 1e-4."""
    servers = start_servers(tiny_vlm, 2)
    try:
        trainer = _server_run(
            tiny_vlm, tmp_path, servers, method, max_steps=2, beta=0.05, generation_kwargs={"seed": 0}
        )
        rendered = _recorded_renders(trainer.vllm_generation)
        trainer.train()
    finally:
        for server in servers:
            server.stop()
    logs = step_logs(trainer, ("loss", "reward"))
    assert len(logs) == 2 and trainer.vllm_generation.sync_count >= 1
    assert len(rendered) == 2 * 4 // 2  # one render per prompt, not per completion
    # the policy's (and reference's) scoring calls with images ran through the chunked head (test_image_scoring.py)
    assert all(e.get("chunked_head/image_calls", 0) >= 1 for e in trainer.state.log_history if "loss" in e)
    if method == "grpo":  # TRL logs how far the sampler's log-probs are from the policy's
        gaps = _sampling_gaps(trainer)
        assert len(gaps) == 2 and max(gaps) <= 1e-4, gaps


@pytest.mark.parametrize("mode", ["streaming", "ordered"])
def test_a_vision_language_policy_reads_ahead_over_two_servers(tiny_vlm, tmp_path, mode):
    """Streaming and ordered GRPO (staleness 1) with images: each prompt group's images rendered once when it is
    sent and paired with its request; every completion drawn by one version's weights has the policy's log-probs at
    that version with its own images (<= 1e-4: a group given another's images is off by ~0.1 once a step has
    trained)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from trl_scale.rollout.images import image_urls

    processor = AutoProcessor.from_pretrained(tiny_vlm)
    servers = start_servers(tiny_vlm, 2)
    try:
        trainer = _server_run(
            tiny_vlm, tmp_path, servers, max_steps=3, beta=0.0, async_rollout_staleness=1, shuffle_dataset=False,
            generation_kwargs={"seed": 1}, dataset=_image_prompts(32), async_rollout_mode=mode,
        )  # fmt: skip
        generation = trainer.vllm_generation
        rendered, render = [], generation.client.render
        generation.client.render = lambda images, row: rendered.append((row, tuple(images))) or render(images, row)
        checked, weights = [], {}  # weights: the policy's at each sync (what the servers then served)
        sync, generate = generation.sync_weights, trainer._generate

        def synced():
            sync()
            state = trainer.accelerator.unwrap_model(trainer.model).state_dict()
            weights[generation.sync_count] = {name: tensor.clone() for name, tensor in state.items()}

        def generated(prompts):
            out = generate(prompts)
            record = generation.steps.newest_record()
            for row, ((first, newest), sampled) in enumerate(zip(record.version_spans, record.sampler_logprobs)):
                images = [part["image"] for part in prompts[row][0]["content"] if part["type"] == "image"]
                assert image_urls(images) in {urls for _, urls in rendered}  # its group's images went to a server
                if first == newest:  # drawn by one version's weights: the policy's log-probs then, its images
                    policy = AutoModelForImageTextToText.from_config(trainer.model.config).eval()
                    policy.load_state_dict(weights[first])
                    got = _policy_logprobs(policy, processor, list(out[0][row]), images, list(out[1][row]))
                    checked.append((first, max(abs(a - b) for a, b in zip(got, sampled))))
            return out

        generation.sync_weights = synced

        trainer._generate = generated
        trainer.train()
    finally:
        for server in servers:
            server.stop()
    assert len(step_logs(trainer, ("loss",))) == 3
    if mode == "streaming":
        groups = generation.ahead.streamer._read
        assert len(rendered) == groups and len({index for index, _ in rendered}) == groups  # once per group
    else:  # batches after the first served from their prefetched requests, each group's images rendered once
        assert generation.ahead.prefetcher.served_from_prefetch >= 2
        assert len(rendered) == len(set(rendered))
    assert {version for version, _ in checked} >= {1, 2}, checked  # the first weights, and trained ones
    assert max(gap for _, gap in checked) <= 1e-4, checked


def test_rows_with_one_text_and_other_images_are_other_prompt_groups():
    """A prompt group is a run of copies of one row: equal token ids (the image tokens are the same for any image)
    with other images are another group, and copies holding equal images in separate objects are one."""
    from trl_scale.rollout.images import image_keys, row_images
    from trl_scale.rollout.streaming import _groups

    red, blue = _image((255, 0, 0)), _image((0, 0, 255))
    rows = [{"prompt": "count", "image": image} for image in (red, red.copy(), blue, blue.copy(), red.copy())]
    groups = list(_groups(rows, [[1, 2]] * len(rows), image_keys(row_images(rows))))
    assert [len(group_rows) for group_rows, _ in groups] == [2, 2, 1]
    assert row_images([{"prompt": "count"}]) is None and image_keys([None, []]) == [(), ()]


def test_a_server_killed_mid_stream_with_images_loses_and_duplicates_no_group(tiny_vlm, tmp_path):
    """Streaming with images over two servers, one killed after step 2: its requests (and their images' renders)
    fail over to the other; every prompt group read is trained once, whole, and the run ends."""
    from collections import Counter

    from transformers import TrainerCallback

    trained: list[int] = []

    def recorded_reward(completion_ids, id, **kwargs):
        trained.extend(id)
        return _length_reward(completion_ids)

    dataset = _image_prompts(64).add_column("id", list(range(64)))
    servers = start_servers(tiny_vlm, 2)
    try:
        trainer = _server_run(
            tiny_vlm, tmp_path, servers, reward=recorded_reward, dataset=dataset, max_completion_length=4,
            max_steps=5, beta=0.0, async_rollout_staleness=1, rollout_request_timeout=30, shuffle_dataset=False,
            generation_kwargs={"seed": 1},
        )  # fmt: skip

        at_kill = {}

        class KillOne(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 2:
                    # Read before the kill, under the client's lock: a response already read when the server dies
                    # still counts as served, so the dead server ends between `served` and `served + outstanding`.
                    client = trainer.vllm_generation.client
                    with client._lock:
                        at_kill.update((s.url, (s.served, s.served + s.outstanding)) for s in client.servers)
                    servers[0].stop()

        trainer.add_callback(KillOne())
        trainer.train()
    finally:
        for server in servers:
            if server.process.poll() is None:
                server.stop()
    counts = Counter(trained)
    assert len(counts) == 5 * 4 // 2 and set(counts.values()) == {2}, counts  # each group once, whole
    dead, alive = trainer.vllm_generation.client.servers
    assert servers[0].process.poll() is not None and 0 < at_kill[dead.url][0] <= dead.served <= at_kill[dead.url][1]
    assert alive.served > at_kill[alive.url][1]  # the groups after the kill went to the other server


def test_an_answer_holding_an_image_token_is_drawn_again(tiny_vlm, tmp_path):
    """A sampled image token would reach TRL's step without an image ("Image features and image tokens do not
    match": TRL's local generation suppresses the token, its server path does not). trl-scale's client draws such an
    answer again: the run trains on, on answers without it. Seed 0 draws one in this run (asserted)."""
    servers = start_servers(tiny_vlm, 2)
    try:
        trainer = _server_run(
            tiny_vlm, tmp_path, servers, max_steps=3, beta=0.0, async_rollout_staleness=1, shuffle_dataset=False,
            generation_kwargs={"seed": 0}, dataset=_image_prompts(32),
        )  # fmt: skip
        trainer.train()
    finally:
        for server in servers:
            server.stop()
    assert trainer.state.global_step == 3 and trainer.vllm_generation.client.answers_redrawn > 0


def test_a_policy_that_keeps_sampling_its_image_token_stops_the_run_naming_the_fix(monkeypatch):
    """Redraws are bounded: an answer that holds the image token in every draw fails with the fix named, and each
    redraw has its own seed."""
    from trl_scale.errors import RolloutError
    from trl_scale.rollout import client as client_module

    client = client_module.RolloutClient(["http://127.0.0.1:9"], redraw_tokens=frozenset([7]))
    seeds = []

    def answer(server, payload, continue_cut, on_dispatch):
        seeds.append(payload.get("seed"))
        client._release(server, ok=True)
        return [{"token_ids": [1, 7, 2], "finish_reason": "stop", "index": 0}]

    monkeypatch.setattr(client, "_send", answer)
    try:
        with pytest.raises(RolloutError, match=r"in 8 draws of one answer in a row.*Fix: lower the temperature"):
            client.complete([1, 2], 1, seed=5)
    finally:
        client.close()
    assert len(seeds) == client_module.REDRAWS + 1 and len(set(seeds)) == len(seeds)
    assert client.answers_redrawn == client_module.REDRAWS + 1


def test_two_answers_of_one_request_holding_the_image_token_are_drawn_again_with_their_own_seeds(monkeypatch):
    """With n > 1, each answer that held the token is drawn with a seed of its own: one seed for both would draw the
    same answer twice for the group."""
    from trl_scale.rollout import client as client_module

    client = client_module.RolloutClient(["http://127.0.0.1:9"], redraw_tokens=frozenset([7]))
    sent = []

    def answer(server, payload, continue_cut, on_dispatch):
        sent.append(payload.get("seed"))
        client._release(server, ok=True)
        if payload["n"] == 2:
            return [{"token_ids": [7], "finish_reason": "stop", "index": i} for i in range(2)]
        return [{"token_ids": [len(sent)], "finish_reason": "stop", "index": 0}]

    monkeypatch.setattr(client, "_send", answer)
    try:
        choices = client.complete([1, 2], 2, seed=5)
    finally:
        client.close()
    assert [c["index"] for c in choices] == [0, 1] and len(set(sent)) == 3, sent


def test_a_peaked_policys_sampler_log_probs_are_its_own(tiny_vlm, tmp_path):
    """The sampler's log-probs are the policy's (<= 1e-4) on a policy whose answers are peaked. A random tiny
    model's near-uniform answers hide a wrong logit transform (its logits are too small for soft-capping to matter):
    the tiny VLM's text config once carried a soft-cap that Gemma3ForConditionalGeneration never applies, and the
    trainer's head did (2e-3 off after the visual task's warm-up; 3e-5 on the random model)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # logits of ~10: a peaked distribution
    sharp = str(tmp_path / "sharp")
    model.save_pretrained(sharp)
    AutoProcessor.from_pretrained(tiny_vlm).save_pretrained(sharp)
    servers = start_servers(sharp, 1)
    try:
        trainer = _server_run(sharp, tmp_path / "out", servers, max_steps=1, beta=0.0, generation_kwargs={"seed": 0})
        trainer.train()
    finally:
        for server in servers:
            server.stop()
    log = trainer.state.log_history[0]
    assert log["entropy"] < 2.5, log["entropy"]  # the check has teeth: answers are far from uniform
    assert log["sampling/sampling_logp_difference/max"] <= 1e-4, log["sampling/sampling_logp_difference/max"]


def test_a_streamed_tool_conversation_sends_its_images_with_every_turn(tool_vlm, tmp_path):
    """Streaming GRPO (staleness 1) with a tool over two `trl-scale serve` servers, on image prompts: the tiny VLM
    taught to call `tick` (`toy.tools.build_tool_calling_vlm`) converses in the stream, and each later turn is sent
    with its prompt's image, the group's features rendered once for all its turns. Every sampled token's log-prob
    is the policy's with the image (<= 1e-4; learning rate 0, so the policy stays the servers' weights). Red when a
    later turn goes without its image: the server then reads its image tokens as text (0.08 off, measured)."""
    from trl_scale.toy.tools import tick
    from trl_scale.toy.visual import squares_prompts

    path = tool_vlm
    servers = start_servers(path, 2)
    try:
        trainer = _server_run(
            path, tmp_path / "run", servers, dataset=squares_prompts(16), agents={"tools": [tick]},
            max_completion_length=96, max_tool_calling_iterations=2, max_steps=2, async_rollout_staleness=1,
            learning_rate=0.0, beta=0.0, generation_kwargs={"seed": 0},
        )  # fmt: skip
        generation, sent, rendered = trainer.vllm_generation, [], _recorded_renders(trainer.vllm_generation)
        send_group = generation.send_group

        def recorded(ids, n, dispatched=None, identity=None, images=(), *rest):
            sent.append((n, bool(images)))
            return send_group(ids, n, dispatched, identity, images, *rest)

        generation.send_group = recorded
        trainer.train()
    finally:
        for server in servers:
            server.stop()
    later = [with_images for n, with_images in sent if n == 1]  # a group's first turn asks for its G answers at once
    assert later and all(later), sent  # later turns were sent, each with its image
    assert max(e.get("tools/call_frequency", 0) for e in trainer.state.log_history) > 0
    gaps = _sampling_gaps(trainer)
    assert len(gaps) == 2 and max(gaps) <= 1e-4, gaps
    groups = generation.ahead.streamer._read
    assert len(rendered) <= 2 * groups, (len(rendered), groups)  # per group: its first turn and its later ones


def _looking_tick() -> list:
    """The next number word."""
    return [{"type": "image", "image": _image((0, 0, 255))}, {"type": "text", "text": "five"}]


_looking_tick.__name__ = "tick"  # the call the tool-calling VLM was taught


_ROLLOUT_MODES = {
    "streaming": {"async_rollout_staleness": 1},
    "ordered": {"async_rollout_staleness": 1, "async_rollout_mode": "ordered"},
    "synchronous": {"async_rollout_staleness": 0},
}


@pytest.mark.parametrize("mode", ["streaming", "ordered", "synchronous"])
def test_a_tool_answering_with_an_image_sends_it_with_the_next_turn(tool_vlm, tmp_path, mode):
    """GRPO over two `trl-scale serve` servers with a tool that answers with an image, as TRL 1.16's loop takes
    (content blocks), streaming (the loop runs in the stream), ordered (first turns read ahead, later turns in the
    step) and synchronous: the next turn is rendered with both images, the prompt's and the tool's, in the order their
    tokens sit. Streaming: every token a later turn samples has the policy's log-prob given both (<= 1e-4, computed
    here from the token ids and the images alone; learning rate 0). All three: TRL's step scores the whole
    conversations as they were sampled (its sampling gap <= 1e-4). Red when the turn goes without the tool's image
    (the server refuses the ids' extra image tokens)."""
    from trl_scale.toy.visual import squares_prompts

    servers = start_servers(tool_vlm, 2)
    try:
        trainer = _server_run(
            tool_vlm, tmp_path, servers, dataset=squares_prompts(16), agents={"tools": [_looking_tick]},
            max_completion_length=160, max_tool_calling_iterations=1, max_steps=2, **_ROLLOUT_MODES[mode],
            learning_rate=0.0, beta=0.0, generation_kwargs={"seed": 0},
        )  # fmt: skip
        generation, turns, renders = trainer.vllm_generation, [], _recorded_renders(trainer.vllm_generation)
        send_group = generation.send_group

        def recorded(ids, n, dispatched=None, identity=None, images=(), *rest):
            choices, version = send_group(ids, n, dispatched, identity, images, *rest)
            if n == 1:  # a later turn (a group's first asks for its G answers at once)
                turns.append((list(ids), images, generation.turn_outputs(choices)))
            return choices, version

        generation.send_group = recorded
        trainer.train()
    finally:
        for server in servers:
            server.stop()
    assert len(step_logs(trainer, ("loss",))) == 2
    assert any(count == 2 for _, count in renders), renders  # a later turn's images: the prompt's and the tool's
    # TRL's step scores the conversations as the servers sampled them: its image token types cover the tool's image
    # (Gemma 3's image token is not among the names TRL looks for: 8e-3 off without trl-scale's `ToolImages`)
    trl_gaps = _sampling_gaps(trainer)
    assert len(trl_gaps) == 2 and max(trl_gaps) <= 1e-4, trl_gaps
    if mode != "streaming":
        return
    assert turns and all(len(images) == 2 for _, images, _ in turns), [len(i) for _, i, _ in turns]
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from trl_scale.serve.multimodal import decoded_image

    model = AutoModelForImageTextToText.from_pretrained(tool_vlm, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(tool_vlm)
    gaps = []
    for ids, images, ((completion,), (sampled,)) in turns:
        policy = _policy_logprobs(model, processor, ids, [decoded_image(url, "image") for url in images], completion)
        gaps.extend(abs(a - b) for a, b in zip(policy, sampled, strict=True))
    assert gaps and max(gaps) <= 1e-4, max(gaps)


def test_local_generation_takes_a_tool_answering_with_an_image(tool_vlm, tmp_path):
    """TRL's local generation (no servers) with a tool that answers with an image, on the tiny Gemma 3: the turn after
    it is generated with both images and the step trains. TRL 1.16 alone stops at that turn (it hands the image
    processor's `num_crops` to `generate`); trl-scale's `ToolImages` drops it (red without: a ValueError)."""
    from transformers import AutoProcessor

    from trl_scale.toy.visual import squares_prompts

    args = trl_scale.GRPOConfig(
        **cpu_args(tmp_path, per_device_train_batch_size=4, num_generations=2, max_completion_length=96, max_steps=1)
    )
    trainer = trl_scale.GRPOTrainer(
        model=tool_vlm, reward_funcs=_length_reward, args=args, train_dataset=squares_prompts(8),
        processing_class=AutoProcessor.from_pretrained(tool_vlm), tools=[_looking_tick],
    )  # fmt: skip
    trainer.train()
    (log,) = step_logs(trainer, ("loss", "tools/call_frequency"))
    assert log["tools/call_frequency"] > 0, log


class _LookingEnvironment:
    """An environment on the squares prompts: its reset adds to the prompt (as TRL appends what `reset()` returns),
    and its one tool answers with an image."""

    resets: list = []  # the rows' image columns, as reset() got them

    def reset(self, **row) -> str:
        type(self).resets.append(row.get("image") is not None)
        return " count"

    def tick(self) -> list:
        """The next number word."""
        return _looking_tick()


def _episode_run(path, tmp_path, dataset, environment, **overrides):
    """Streaming GRPO (staleness 1) with `environment` over two `trl-scale serve` servers, learning rate 0: the
    trainer, and how many images each render the client asked for carried."""
    servers = start_servers(path, 2)
    try:
        trainer = _server_run(
            path, tmp_path, servers, dataset=dataset, agents={"environment_factory": environment},
            max_completion_length=160, max_tool_calling_iterations=1, max_steps=2, async_rollout_staleness=1,
            learning_rate=0.0, beta=0.0, generation_kwargs={"seed": 0}, **overrides,
        )  # fmt: skip
        renders = _recorded_renders(trainer.vllm_generation)
        trainer.train()
    finally:
        for server in servers:
            server.stop()
    return trainer, [count for _, count in renders]


@pytest.mark.parametrize("mode", ["streaming", "ordered"])
def test_an_environment_episode_in_the_stream_takes_its_rows_images(tool_vlm, tmp_path, mode):
    """GRPO with an `environment_factory` on image prompts over two `trl-scale serve` servers, its episodes run in the
    stream (streaming, and ordered): each row reset with its row, its prompt (the reset's observation appended) made
    multimodal as TRL's step makes it, its first turn sent with the row's image, and a later turn, after the
    environment's tool answered with an image, with both. TRL's step scores the conversations as they were sampled
    (its sampling gap <= 1e-4; learning rate 0). Red when the first turn goes without its image (no first-turn
    render)."""
    from trl_scale.toy.visual import squares_prompts

    _LookingEnvironment.resets = []
    trainer, rendered = _episode_run(
        tool_vlm, tmp_path, squares_prompts(16), _LookingEnvironment, async_rollout_mode=mode
    )
    assert len(step_logs(trainer, ("loss",))) == 2
    assert _LookingEnvironment.resets and all(_LookingEnvironment.resets)  # each reset got its row, image included
    # each group's first turn rendered its row's image; a later turn after the tool's image, both
    assert rendered.count(1) >= 4 and 2 in rendered, rendered
    assert max(e.get("tools/call_frequency", 0) for e in trainer.state.log_history) > 0
    trl_gaps = _sampling_gaps(trainer)
    assert len(trl_gaps) == 2 and max(trl_gaps) <= 1e-4, trl_gaps


class _ShowingEnvironment:
    """An environment whose reset shows the image (content blocks, as TRL appends a list to the last message), on
    prompts without an image column."""

    def reset(self, **row) -> list:
        return [{"type": "image", "image": _image((255, 0, 0))}]

    def tick(self) -> str:
        """The next number word."""
        return "five"


def test_an_environment_whose_reset_shows_an_image_streams_it(tool_vlm, tmp_path):
    """Streaming GRPO with an environment whose `reset()` answers with an image, on text prompts: each row's first
    turn is sent with the image its reset showed (found in its prompt, as TRL's tokenization finds it), and TRL's step
    scores the conversations as sampled (its sampling gap <= 1e-4)."""
    from trl_scale.toy.visual import squares_prompts

    trainer, rendered = _episode_run(
        tool_vlm, tmp_path, squares_prompts(16).remove_columns("image"), _ShowingEnvironment
    )
    assert rendered.count(1) >= 4, rendered  # each group's first turn, with its image
    trl_gaps = _sampling_gaps(trainer)
    assert len(trl_gaps) == 2 and max(trl_gaps) <= 1e-4, trl_gaps


def test_a_streamed_rollout_func_generates_with_its_groups_images(tiny_vlm, tmp_path):
    """Streaming GRPO (staleness 1) with a `rollout_func` over two `trl-scale serve` servers, on image prompts: each
    group's call gets its prompts as TRL's step builds them (content lists holding their images) and generates
    through `trainer.vllm_generation.generate(prompt_ids, images, G)`, TRL's interface, each prompt's images rendered
    for its request. Every sampled token's log-prob is the policy's with the image (<= 1e-4; learning rate 0): red
    when the request goes without its images."""
    calls = []

    def rollout_func(prompts, trainer):
        prompt_ids, images, _ = trainer._tokenize_prompts(prompts)  # as TRL's step tokenizes them
        calls.append(sum(1 for row in images or [] if row))
        _, completion_ids, logprobs, _ = trainer.vllm_generation.generate(
            prompts=prompt_ids, images=images, num_generations=trainer.num_generations
        )
        sampled = [[top[0] for top in row] for row in logprobs]  # each token's top-k: the sampled one first
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": sampled}

    servers = start_servers(tiny_vlm, 2)
    try:
        trainer = _server_run(
            tiny_vlm, tmp_path, servers, agents={"rollout_func": rollout_func}, max_completion_length=8, max_steps=2,
            async_rollout_staleness=1, learning_rate=0.0, beta=0.0, generation_kwargs={"seed": 0},
        )  # fmt: skip
        trainer.train()
    finally:
        for server in servers:
            server.stop()
    assert calls and all(count == 2 for count in calls), calls  # each group's call: its 2 rows, with their image
    gaps = _sampling_gaps(trainer)
    assert len(gaps) == 2 and max(gaps) <= 1e-4, gaps


def test_a_batch_where_some_rows_have_no_image_keeps_the_others_images():
    """Rows without an image beside rows with one: the batch has images (each row its own, None where it has none);
    only a batch where no row has one has none."""
    from trl_scale.rollout.images import row_images

    red = _image((255, 0, 0))
    assert row_images([{"prompt": "a", "image": red}, {"prompt": "b", "image": None}]) == [[red], None]
    assert row_images([{"prompt": "a", "images": []}, {"prompt": "b", "images": [red]}]) == [[], [red]]
    assert row_images([{"prompt": "a", "image": None}, {"prompt": "b", "image": None}]) is None


def test_an_episodes_rows_with_one_prompt_and_other_images_go_as_separate_requests():
    """`_send_each` (an environment episode's first turns): one request per run of equal prompts *and* equal images;
    two rows with one prompt and two images are two requests, each with its own image."""
    from trl_scale.rollout.images import image_urls
    from trl_scale.rollout.streaming import _send_each

    red, blue = _image((255, 0, 0)), _image((0, 0, 255))
    sent = []

    def send(ids, n, dispatched, identity=None, images=(), index=-1):
        sent.append((list(ids), n, tuple(images)))
        return [{"token_ids": [1]} for _ in range(n)], 0

    _send_each(send, [[5, 6], [5, 6], [5, 6]], None, [[red], [blue], [blue.copy()]])
    assert sent == [([5, 6], 1, image_urls([red])), ([5, 6], 2, image_urls([blue]))]
