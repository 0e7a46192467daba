import torch

# The test models are tiny: one intra-op thread is several times faster than many on 2 cores.
torch.set_num_threads(1)
