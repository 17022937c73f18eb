"""The learner: policy and reference models in Ray actors (FSDP2 ranks), their state and weight sending."""
