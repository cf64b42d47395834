"""What the PyTorch baselines share: the IDX reader and the seed recipe's CNN.

Kept free of a top-level torch import so scripts that may run without torch (gpu_cnn.py's
lockstep-only mode) can import the reader.
"""
import gzip
import os
import struct
import sys

import numpy as np


def read_idx(path):
    """An IDX file (gzip or raw) as a uint8 array of its dimensions."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    _zero, _type, ndim = struct.unpack(">HBB", data[:4])
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def find(data_dir, name):
    """`data_dir/name.gz`, else `data_dir/name`; exits with a hint when neither exists."""
    p = os.path.join(data_dir, name)
    if os.path.exists(p + ".gz"):
        return p + ".gz"
    if os.path.exists(p):
        return p
    sys.exit(f"{p}(.gz) not found: pass --data DIR with the FashionMNIST IDX files")


def cnn_model():
    """A fresh instance of the seed's CNN (PyTorch state_dict names, as train-cnn writes them)."""
    import torch.nn as nn

    class CNNModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.module1 = nn.Sequential(nn.Conv2d(1, 32, 5, 1, 2), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2, 2))
            self.module2 = nn.Sequential(nn.Conv2d(32, 64, 5, 1, 2), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2, 2))
            self.flatten = nn.Flatten()
            self.linear1 = nn.Linear(7 * 7 * 64, 64)
            self.linear2 = nn.Linear(64, 10)
            self.relu = nn.ReLU()

        def forward(self, x):
            out = self.flatten(self.module2(self.module1(x)))
            return self.linear2(self.relu(self.linear1(out)))

    return CNNModel()
