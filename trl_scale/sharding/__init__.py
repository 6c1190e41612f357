"""How a model the trainer holds outside TRL's engine is laid out across processes: ZeRO-3 helpers (`zero.py`),
below the critic's holders (`critic.holders`) and the Ray backend."""
