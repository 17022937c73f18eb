"""The contracts between rollout's rooms: what the drivers, the rollout context and the tasks may ask of an engine
fleet and of the policy learner that feeds it. Everything here is a declaration; the SGLang wire it speaks is
rollout/sglang/protocol.py."""
