"""After: ddp_digits.py on hvdtrain, a small conv net on scikit-learn's handwritten digits (8x8).

    horovodrun -np 2 -H localhost:2 --gloo python hvdtrain_digits.py --epochs 10 --batch-size 64

SGD at a constant learning rate, a global batch of 64, validation accuracy every epoch; a rerun
resumes from the last epoch's snapshot. docs/from-ddp.md shows the diff.
"""
import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import TensorDataset

import hvdtrain


def digits_datasets():
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    train_x, val_x, train_y, val_y = train_test_split(images, labels, test_size=0.2, stratify=labels,
                                                      random_state=0)
    return TensorDataset(train_x, train_y), TensorDataset(val_x, val_y)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def main(args):
    train_set, val_set = digits_datasets()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    hvdtrain.fit_model(model, optimizer, train_set, val_set, F.cross_entropy, config={
        "train.epochs": args.epochs, "train.global_batch_size": args.batch_size, "output.dir": args.out})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a conv net on the 8x8 digits, DDP")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, all ranks together")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--out", default="runs/digits")
    main(parser.parse_args())
