"""The seams of TRL's trainers and generation, transformers' Trainer and accelerate: what trl-scale overrides, calls,
reads or repeats of them (see the package docstring)."""

from __future__ import annotations

from .seam import ATTRIBUTE, CALL, CONFIG, CONSTANT, COPY, OVERRIDE, G, Seam, T, U, V

TRAINER_SEAMS: tuple[Seam, ...] = (
    # ---- GRPO/RLOO trainers: overridden methods ------------------------------------------------------------------
    Seam(
        f"{G}._generate",
        OVERRIDE,
        "trainers/adapter.py: timing.py PhaseTiming, dynamic_sampling.py DynamicSampling",
        "generation of one batch's prompts; timed around super(). Dynamic sampling calls it on its candidate rows "
        "and answers TRL's call with the chosen rows: it returns a tuple of per-row lists (GRPO 8 values: prompt "
        "ids, completion ids, tool mask, completions, logprobs, extra fields (a dict of lists), images, tool images; "
        "RLOO 3: prompt ids, completion ids, completions), and TRL's _generate_and_score_completions calls it "
        "once, with [row['prompt'] for row in inputs] when no environment or image column is involved",
        "(self, prompts: list)",
    ),
    Seam(
        f"{G}._calculate_rewards",
        OVERRIDE,
        "trainers/adapter.py: step_checks.py, timing.py, dynamic_sampling.py; trainers/ppo_trainer.py",
        "returns [num completions of all processes, num reward functions] with NaN where a function gave None, "
        "called once per TRL step (dynamic sampling answers that call with the chosen rows' rewards); "
        "PPO reads it as every completion's score (sliced by process_index)",
        "(self, inputs, prompts, completions, completion_ids_list)",
    ),
    Seam(
        f"{G}._get_per_token_logps_and_entropies",
        OVERRIDE,
        "trainers/adapter.py: timing.py, remote_reference.py; trainers/ppo_trainer.py",
        "every log-prob forward of policy and reference; the parameters after compute_aux_loss are the image inputs "
        "PPO passes on (ppo_trainer.MULTIMODAL_FIELDS is derived from them)",
        "(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, "
        "compute_aux_loss=False, pixel_values=None, image_grid_thw=None, num_images=None, pixel_attention_mask=None, "
        "spatial_shapes=None, num_tiles=None, image_sizes=None, token_type_ids=None, mm_token_type_ids=None, "
        "image_position_ids=None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]",
    ),
    Seam(
        f"{G}._generate_single_turn",
        OVERRIDE,
        "trainers/adapter.py: packing.py PackedScoring (local generation under sequence parallelism)",
        "the local (transformers) generation of one turn; trl-scale runs it with the model's own attention, since "
        "the sharded attention expects every rank of the group to call it with a slice of one row",
        "(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False)",
    ),
    Seam(
        f"{G}._tool_call_loop",
        OVERRIDE,
        "trainers/adapter.py: server_rollout.py ServerRollout (asynchronous tool rollouts)",
        "runs after the first turn's generate call, with the first turn's completions (completions[i][0] the "
        "assistant message, its 'tool_calls' set when it called a tool) and generates the later turns through "
        "vllm_generation.generate; returns (tool_mask, completions, completion_ids, logprobs, ...)",
        "(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields)",
    ),
    Seam(
        f"{G}._get_tool_suffix_ids",
        OVERRIDE,
        "trainers/adapter.py: tool_images.py TextPolicyToolAnswers",
        "called by TRL's tool loop (and the streamed one) with a turn's trailing tool messages, each a dict with "
        "'role', 'name' and 'content' (a string, or TRL's content blocks for a multimodal answer); returns the ids "
        "that follow the completion",
        "(self, tool_messages)",
    ),
    Seam(
        f"{G}._tool_call_loop",
        COPY,
        "trainers/streamed_tools.py (streamed tool rollouts)",
        "TRL's own loop is called on a view of the trainer in a stream thread, for one prompt group: it reads "
        "_sync_tool_dicts/_async_tool_dicts per row, generates every later turn through self._generate_single_turn "
        "(prompt ids, images, multimodal fields, num_generations=1, has_tool_images) -> (ids, top-1 log-probs), "
        "reaches super() only for tool images of a vision-language model, and returns (tool_mask, completions, "
        "completion_ids, logprobs, tool calls, tool failures, tool images)",
        "sha:1c501f7f3b46",
    ),
    Seam(
        f"{G}._generate",
        COPY,
        "trainers/streamed_tools.py first_turn_messages",
        "decodes the first turn before the tool loop: conversational prompts with a response template (or schema) "
        "through parse_response(tokenizer, ids, prefix=prompt ids, tools=self.tools), else batch_decode",
        "sha:2a27fdf8f5e6",
    ),
    Seam(
        G,
        ATTRIBUTE,
        "trainers/streamed_tools.py (the tool tables of a streamed group)",
        "the tools not bound to an environment, a list of functions (coroutine functions for async tools)",
        attribute="_standalone_tools",
    ),
    Seam(
        G,
        ATTRIBUTE,
        "trainers/streamed_tools.py (a streamed group's own tool tables, on the view its tool loop runs on)",
        "one {name: function} per row of the batch, read by _tool_call_loop by row index (async ones apart)",
        attribute="_sync_tool_dicts",
    ),
    Seam(
        G,
        ATTRIBUTE,
        "trainers/streamed_tools.py (as _sync_tool_dicts)",
        "one {name: coroutine function} per row of the batch, run on self.async_loop",
        attribute="_async_tool_dicts",
    ),
    # ---- environments and rewards in the stream (trainers/stream_environments.py, stream_rewards.py) ----------------
    Seam(
        f"{G}._generate_and_score_completions",
        COPY,
        "trainers/stream_environments.py (with_observation, EpisodeOpener, finished_environments)",
        "with environment_factories: each row's environment is drawn from self._environment_pool[name] (the factory "
        "called when the pool runs out), reset(**row) (without 'environment' in dict mode) is called and a non-None "
        "return is appended to the last message's content (str + str, or list + list, a str turned into a text "
        "block); the prompt defaults to one empty user message; _batch_environments is set from the rows",
        "sha:1fa48922792d",
    ),
    Seam(
        f"{G}._calculate_rewards",
        COPY,
        "trainers/stream_rewards.py StreamRewarder (the arguments a reward function gets, in the stream)",
        "reward functions get prompts, completions, completion_ids and every input column but prompt/completion/"
        "completion_ids, plus trainer_state, log_extra, log_metric and (with environments) environments; nn.Module "
        "rewards are scored from texts; async functions are gathered on self.async_loop; None becomes NaN",
        "sha:736ae29b0838",
    ),
    Seam(
        f"{G}._tokenize_prompts",
        COPY,
        "trainers/stream_environments.py EpisodeOpener (called on a view with the group's _batch_environments)",
        "with environment_factories, renders each prompt with self._env_tools[name] for the name in "
        "self._batch_environments at its index; returns (prompt_ids, ...)",
        "sha:d2d27f7c9bfd",
    ),
    Seam(
        G,
        ATTRIBUTE,
        "trainers/stream_environments.py",
        "{name: instances} TRL draws from",
        attribute="_environment_pool",
    ),
    Seam(
        G,
        ATTRIBUTE,
        "trainers/stream_environments.py",
        "True when environment_factory was a dict (rows name theirs in an 'environment' column)",
        attribute="_multi_environment",
    ),
    Seam(
        G,
        ATTRIBUTE,
        "trainers/stream_environments.py, streamed_tools.py (set on the views a group's work runs on), "
        "dynamic_sampling.py (set for a round's rows)",
        "one environment name per row of the batch being generated, read by _tokenize_prompts, _generate and "
        "_tool_call_loop",
        attribute="_batch_environments",
    ),
    Seam(
        G,
        ATTRIBUTE,
        "trainers/tool_images.py ToolImages (set to the policy's image token where TRL found none by name)",
        "the token id whose positions TRL types as image tokens (token_type_ids / mm_token_type_ids) in a forward "
        "over conversations holding a tool's image; None: every token typed text",
        attribute="_image_pad_token_id",
    ),
    Seam(
        f"{T}._prepare_inputs",
        CALL,
        "trainers/trl_facade.py _group_view (TRL's tool loop calls super()._prepare_inputs on the group's view, "
        "an instance of the trainer's class for that call)",
        "moves a dict of tensors to the trainer's device; takes only an instance of TRL's class",
    ),
    Seam(
        G,
        ATTRIBUTE,
        "trainers/streamed_tools.py first_turn_messages",
        "{name: the tools an environment's rows are rendered and parsed with}",
        attribute="_env_tools",
    ),
    Seam(
        f"{G}._log_completion_extra",
        CALL,
        "trainers/stream_rewards.py (log_extra calls made in the stream, replayed in the step)",
        "extends the pending completions-table column by the values given",
        "(self, column: str, values: list)",
    ),
    Seam(
        f"{G}._log_metric",
        CALL,
        "trainers/stream_rewards.py (log_metric calls made in the stream, replayed in the step)",
        "appends one value to the pending metric",
        "(self, name: str, value: float)",
    ),
    Seam(
        f"{G}._tokenize_prompts",
        OVERRIDE,
        "trainers/adapter.py: step_checks.py ContextLength (prompt length check)",
        "returns (prompt_ids, ...) with prompt_ids a list of token-id lists, before generation",
        "(self, prompts: list)",
    ),
    Seam(
        f"{G}._generate_and_score_completions",
        COPY,
        "trainers/ppo_trainer.py",
        "PPO calls super() and then reads prompt_ids/prompt_mask, completion_ids/completion_mask, tool_mask, "
        "old_per_token_logps, ref_per_token_logps (computed when beta != 0), num_items_in_batch, "
        "importance_sampling_ratio and the image inputs from the batch it returns",
        "sha:1fa48922792d",
    ),
    Seam(
        f"{G}._compute_loss",
        COPY,
        "trainers/ppo_trainer.py",
        "PPO replaces it whole (clipped surrogate + critic); what GRPO's applies to the loss (IS ratio, masks, "
        "loss_type normalisers) must be mirrored or refused in PPOConfig",
        "sha:80295546bbdb",
    ),
    Seam(
        f"{G}.training_step",
        OVERRIDE,
        "trainers/ppo_trainer.py",
        "one micro-step: TRL's training_step then the critic's result; num_items_in_batch passed positionally",
        "(self, model, inputs, num_items_in_batch)",
    ),
    # ---- GRPO trainer: attributes ------------------------------------------------------------------------------
    Seam(
        G,
        ATTRIBUTE,
        "trainers/checkpoints.py (exact resume)",
        "the rollout being trained on, a list of per-step batches, None before the first generation",
        attribute="_buffered_inputs",
    ),
    Seam(
        G,
        ATTRIBUTE,
        "trainers/checkpoints.py (exact resume)",
        "the micro-step counter that picks the batch from _buffered_inputs and decides when to generate",
        attribute="_step",
    ),
    Seam(
        G,
        ATTRIBUTE,
        "trainers/server_rollout.py",
        "the global step at which the weights were last synced (TRL syncs when it differs)",
        attribute="_last_loaded_step",
    ),
    Seam(
        G,
        ATTRIBUTE,
        "trainers/dynamic_sampling.py",
        "a defaultdict(list) of the reward functions' log_extra columns (this process's rows), flushed into the "
        "completions table by _generate_and_score_completions after _calculate_rewards",
        attribute="_pending_extra_logs",
    ),
    Seam(
        G,
        ATTRIBUTE,
        "callbacks/samples.py",
        "a dict of the completions TRL logged last ('prompt', 'completion', 'rewards' by function, 'advantages'), "
        "each a deque, read by name for the samples table",
        attribute="_logs",
    ),
    Seam(
        G,
        ATTRIBUTE,
        "trainers/ppo_trainer.py, trainers/evaluation.py (pass@k into 'eval')",
        "a dict mode -> defaultdict(list) of metric lists, averaged and logged by TRL's log()",
        attribute="_metrics",
    ),
    # ---- transformers Trainer -----------------------------------------------------------------------------------
    Seam(
        f"{T}._save_optimizer_and_scheduler",
        OVERRIDE,
        "trainers/adapter.py (the features' save_state), trainers/ppo_trainer.py",
        "called on every rank while saving a checkpoint, with its folder (rollout buffers, the critic's state)",
        "(self, output_dir: str) -> None",
    ),
    Seam(
        f"{T}._load_optimizer_and_scheduler",
        OVERRIDE,
        "trainers/adapter.py (the features' load_state), trainers/ppo_trainer.py",
        "called on every rank at resume, before the first step, with the checkpoint folder or None",
        "(self, checkpoint: str | None) -> None",
    ),
    Seam(
        f"{T}._save_checkpoint",
        OVERRIDE,
        "trainers/adapter.py: checkpoints.py SafeCheckpoint",
        "writes checkpoint-<global_step> under _get_output_dir(trial); an OSError leaves a partial folder",
        "(self, model: torch.nn.modules.module.Module, trial: 'optuna.Trial | dict[str, Any] | None') -> None",
    ),
    Seam(
        f"{T}._get_output_dir",
        CALL,
        "trainers/checkpoints.py SafeCheckpoint",
        "the run directory checkpoints go to",
        "(self, trial: 'optuna.Trial | dict[str, Any] | None') -> str",
    ),
    Seam(
        f"{T}.init_hf_repo",
        OVERRIDE,
        "trainers/adapter.py: hub.py ModelCard (push_to_hub)",
        "creates the Hub repo; transformers passes private=",
        "(self, token: str | None = None, private: bool | None = None) -> None",
    ),
    # ---- DPO ---------------------------------------------------------------------------------------------------
    Seam(
        "trl.trainer.dpo_trainer:DPOTrainer._precompute_ref_logps",
        OVERRIDE,
        "trainers/dpo_trainer.py",
        "run inside TRL's constructor when precompute_ref_log_probs; packed scoring is installed around it",
        "(self, dataset: datasets.arrow_dataset.Dataset, name: str, batch_size: int) -> "
        "datasets.arrow_dataset.Dataset",
    ),
    Seam(
        "trl.trainer.dpo_config:DPOConfig.padding_free",
        CONFIG,
        "trainers/dpo_trainer.py",
        "TRL 1.16 force-disables its own padding_free; trl-scale hides it from TRL's constructor and packs itself",
    ),
    # ---- config fields rewritten around TRL's constructor --------------------------------------------------------
    Seam(
        "trl.trainer.grpo_config:GRPOConfig.use_vllm",
        CONFIG,
        "trainers/online.py",
        "False while TRL builds (no vLLM import, no CUDA communicator); server rollout installed after",
    ),
    Seam(
        "trl.trainer.grpo_config:GRPOConfig.beta",
        CONFIG,
        "trainers/online.py, trainers/ppo_trainer.py",
        "0 makes TRL build no reference model (remote reference), and skip reference log-probs (PPO sets kl_coef "
        "while generating so TRL computes them)",
    ),
    Seam(
        "trl.trainer.grpo_config:GRPOConfig.loss_type",
        CONFIG,
        "trainers/ppo_config.py",
        "'dapo' and 'bnpo' mean what TRL's _compute_loss computes for them (PPO mirrors both)",
    ),
    # ---- vLLM generation ---------------------------------------------------------------------------------------
    Seam(
        f"{V}.__init__",
        CALL,
        "rollout/generation.py ServerRolloutGeneration",
        "accepts model, accelerator, processing_class, mode='server', server_base_url, server_timeout, "
        "max_completion_length, logprobs as keywords, and calls _init_vllm",
        "sha:3b2cda6d35bb",
    ),
    Seam(
        f"{V}._init_vllm",
        OVERRIDE,
        "rollout/generation.py, rollout/colocate.py",
        "builds the client; replaced by trl-scale's client, preflight and weight-sync choice. Colocate mode builds "
        "the engine by calling the module's `LLM` name (imported only where vLLM is) with keyword arguments and no "
        "dtype: colocate.py swaps that name for the call, adding vllm_llm_kwargs and the policy's dtype",
        "(self)",
    ),
    Seam(
        f"{V}._iter_named_params",
        OVERRIDE,
        "rollout/weight_names.py CheckpointNamedWalk (rollout/generation.py, rollout/colocate.py)",
        "yields (model parameter name, whole tensor) for every weight, gathering ZeRO-3 shards and FSDP DTensors and "
        "merging PEFT adapters, inside the gather (one tensor at a time); wrapped to yield checkpoint names, and "
        "every sync path (TRL's colocated load_weights too) calls it through self",
        "(self)",
    ),
    Seam(
        V,
        ATTRIBUTE,
        "rollout/generation.py",
        "a cached list of (name, dtype, shape) for the NCCL update, reset to None when names change",
        attribute="_weight_metadata",
    ),
    Seam(
        f"{V}.generate",
        OVERRIDE,
        "rollout/generation.py",
        "returns TRL's tuple (prompt_ids, completion_ids, logprobs, extra) for prompt-major num_generations copies",
        "(self, prompts: list[list[int]], images: list[list | None] | None, num_generations: int, profiler: "
        "trl.extras.profiling.ProfilingContext | None = None) -> tuple",
    ),
    Seam(
        f"{V}.sync_weights",
        OVERRIDE,
        "rollout/generation.py",
        "called by TRL when the global step moved since the last sync, on every rank",
        "(self)",
    ),
    Seam(
        V,
        ATTRIBUTE,
        "rollout/colocate.py",
        "colocate mode with sleep mode: True while the engine's weights sleep; cleared once they are woken for a sync",
        attribute="_llm_weights_sleeping",
    ),
    Seam(
        f"{V}.sync_weights",
        COPY,
        "rollout/colocate.py ColocatedVLLMGeneration.sync_weights",
        "colocate mode: wakes the weights (sleep mode), writes every _iter_named_params tensor into the engine "
        "through driver_worker.model_runner.model.load_weights, then reset_prefix_cache; trl-scale repeats the "
        "wake-up and routes the writes through driver_worker.reload_weights where the engine repacked its weights",
        "sha:63d669fb3230",
    ),
    Seam(
        "trl.trainer.grpo_trainer:VLLMGeneration",
        CONSTANT,
        "rollout/colocate.py colocated_generation",
        "the name GRPOTrainer.__init__ builds its vLLM generation with (also PPO's); swapped while it runs",
    ),
    Seam(
        "trl.trainer.rloo_trainer:VLLMGeneration",
        CONSTANT,
        "rollout/colocate.py colocated_generation",
        "the name RLOOTrainer.__init__ builds its vLLM generation with; swapped while it runs",
    ),
    # ---- sequence parallelism: a group as one data-parallel rank (sharding/data_parallel.py) --------------------
    *(
        Seam(
            f"trl.trainer.{module}:{name}",
            CONSTANT,
            "sharding/data_parallel.py data_parallel_gathers (trainers/packing.py PackedScoring)",
            f"the accelerate `{name}` TRL's {module} calls by its module-level name (rewards, KL, logs) while it "
            "builds a batch; swapped for one taking one copy per sequence-parallel group during that call",
        )
        for module in ("grpo_trainer", "rloo_trainer")
        for name in ("gather", "gather_object")
    ),
    Seam(
        "accelerate.accelerator:Accelerator._prepare_deepspeed",
        OVERRIDE,
        "sharding/data_parallel.py DataParallelAccelerator",
        "prepares the data loaders first (through prepare_data_loader, which must see the groups) and then sizes "
        "DeepSpeed's train_batch_size with self.num_processes (which must see every rank: DeepSpeed averages over "
        "all of them)",
        "(self, *args)",
    ),
    Seam(
        "accelerate.accelerator:Accelerator.prepare_data_loader",
        OVERRIDE,
        "sharding/data_parallel.py DataParallelAccelerator",
        "shards the data loader by self.num_processes / self.process_index (the groups under the view)",
        "(self, data_loader: 'torch.utils.data.DataLoader', device_placement=None, slice_fn_for_dispatch=None)",
    ),
    # ---- the fused log-prob head --------------------------------------------------------------------------------
    Seam(
        f"{U}:add_fused_lm_head",
        COPY,
        "scoring/engine.py, scoring/logprob_head.py",
        "model.forward becomes TRL's fused forward taking fused_lm_head/labels/shift_labels/num_items_in_batch and "
        "returning FusedCausalLMOutput; logit_transform_of repeats its softcap/logit_scale rule",
        "sha:422d009f04b6",
    ),
    Seam(
        f"{U}:FusedCausalLMOutput",
        COPY,
        "scoring/engine.py",
        "fields loss, log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1, label_mask, aux_loss",
        "sha:5ccdd6e41dcb",
    ),
    Seam(
        f"{U}:maybe_gather_lm_head_ctx",
        CALL,
        "scoring/logprob_head.py",
        "gathers ZeRO-3 partitions of the head's weight and bias for the block",
        "(*params: torch.nn.parameter.Parameter)",
    ),
    Seam(
        f"{U}:_CHUNKED_LOGPROB_CHUNK_SIZE",
        CONSTANT,
        "scoring/logprob_head.py",
        "the chunk size TRL's Triton kernel is called with",
    ),
    Seam(
        "trl.kernels.chunked_logprob:_use_triton",
        CALL,
        "scoring/logprob_head.py",
        "whether TRL's Triton kernel serves this device",
        "(device: 'torch.device') -> 'bool'",
    ),
    Seam(
        "trl.kernels:ChunkedLogProbFunction.forward",
        CALL,
        "scoring/logprob_head.py",
        "apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs)",
        "sha:1d8220b44273",
    ),
)
