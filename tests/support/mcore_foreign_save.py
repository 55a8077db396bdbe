"""A Megatron-LM torch_dist checkpoint directory as megatron-core 0.16.1 writes it: a small GPTModel's
sharded_state_dict() saved by dist_checkpointing.save into ROOT/iter_0000005, and the tracker Megatron-LM writes
beside it ("5"). Usage: mcore_foreign_save.py ROOT. Prints {"files": the iteration directory's files} as JSON."""

import json
import os
import sys


def main(root):
    import mcore_reference
    from megatron.core import dist_checkpointing

    from megatron_lite.models import GPTConfig

    mcore_reference.init_world()
    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, max_position_embeddings=16)
    model = mcore_reference.build_gpt(config)
    directory = os.path.join(root, "iter_0000005")
    os.makedirs(directory)
    dist_checkpointing.save(model.sharded_state_dict(), directory)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("5")
    print(json.dumps({"files": sorted(os.listdir(directory))}))


if __name__ == "__main__":
    main(sys.argv[1])
