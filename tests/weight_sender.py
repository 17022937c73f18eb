"""A stand-in trainer for the engine-side protocol tests: joins the weight-update group as rank 0 and broadcasts
the tensors of a safetensors file, bucket by bucket (the real sender is tasks/learner/weight_sender.py in a learner actor).

python tests/weight_sender.py ADDRESS PORT WORLD_SIZE GROUP_NAME FILE BUCKETS_JSON
"""
from __future__ import annotations

import json
import sys

from safetensors.torch import load_file

from spillover.rollout.sglang.update_group import destroy_group, init_group, send_bucket


def main() -> None:
    address, port, world_size, group_name, file, buckets = sys.argv[1:7]
    tensors = load_file(file)
    group = init_group(address, int(port), 0, int(world_size), group_name, "gloo", timeout_s=60)
    for bucket in json.loads(buckets):
        send_bucket(group, [tensors[name] for name in bucket])
    destroy_group(group)
    print("sent", flush=True)


if __name__ == "__main__":
    main()
