"""The network of the reconstruction experiments.

Paper 004 (Sec. IV-A) trains "a simplified neural network model consisting of 13,700 parameters"
without giving its layers. privleak uses the network of the gradient-inversion literature (the
LeNet variant of Zhu et al., "Deep leakage from gradients", NeurIPS 2019, which Inverting
Gradients also attacks) sized for one-channel 28 x 28 images: three 5 x 5 convolutions with 12
channels (strides 2, 2, 1), sigmoid activations and one linear layer. That is 13,426 parameters
for 28 x 28 x 1 and 10 classes, the closest this family comes to the paper's 13,700. The sigmoid
keeps the gradient twice differentiable, which the attack's cosine objective needs.

Weights and biases start uniform in [-0.5, 0.5], as in Zhu et al.'s code. With PyTorch's default
(Kaiming-uniform) start the sigmoid features hardly depend on the input: the gradient of a random
image and that of a real digit with the same label have cosine 0.9997, and no attack can tell
them apart. The wider start is the untrained network the gradient-inversion papers attack.
"""
from __future__ import annotations

import math

import torch
from torch import nn

CHANNELS = 12
KERNEL = 5
INIT_RANGE = 0.5


class PaperNetwork(nn.Module):
    """Conv(5x5, 12, /2) - sigmoid - Conv(5x5, 12, /2) - sigmoid - Conv(5x5, 12) - sigmoid - Linear."""

    def __init__(self, image_shape=(1, 28, 28), num_classes: int = 10):
        super().__init__()
        if len(image_shape) != 3 or min(image_shape) < 1:
            raise ValueError(f"image_shape must be (channels, height, width), got {tuple(image_shape)}")
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        channels, height, width = image_shape
        padding = KERNEL // 2
        self.features = nn.Sequential(
            nn.Conv2d(channels, CHANNELS, KERNEL, stride=2, padding=padding), nn.Sigmoid(),
            nn.Conv2d(CHANNELS, CHANNELS, KERNEL, stride=2, padding=padding), nn.Sigmoid(),
            nn.Conv2d(CHANNELS, CHANNELS, KERNEL, stride=1, padding=padding), nn.Sigmoid(),
        )
        features = CHANNELS * math.ceil(height / 4) * math.ceil(width / 4)
        self.classifier = nn.Linear(features, num_classes)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.uniform_(-INIT_RANGE, INIT_RANGE)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
