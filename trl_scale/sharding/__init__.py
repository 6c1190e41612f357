"""How a model the trainer holds outside TRL's engine is laid out across processes, below the critic and the Ray
backend: ZeRO-3 helpers (`zero.py`) and the critic holders, replicated, a DeepSpeed engine or FSDP2
(`critic_sharding.py`)."""
