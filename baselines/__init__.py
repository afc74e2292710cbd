"""The systems the harness compares, one module beside each document (README.md says which is
which): native, fsdp2, deepspeed_zero (zero3, zero_infinity), gemini, ratel, and megatrain, this
repository's engine, wrapped like any other. Each implements `suite.system.System`; hf.py holds
what the `transformers`-model baselines share."""
