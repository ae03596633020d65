"""A small DCGAN on 32x32 images, trained as PyTorch's dcgan example trains it: the
discriminator on a real and a fake batch, then the generator through the discriminator,
BCE losses, Adam(2e-4, betas=(0.5, 0.999)). The "real" images are a fixed synthetic set
(smooth random blobs) so the script needs no download.

    python dcgan.py [--steps 30]
"""

import argparse
import json
import time

import torch
from torch import nn

nz, ngf, ndf, nc = 64, 32, 32, 3


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 4, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, x):
        return self.main(x).view(-1, 1).squeeze(1)


def dataset(n, generator):
    coarse = torch.randn(n, nc, 4, 4, generator=generator)
    images = nn.functional.interpolate(coarse, size=32, mode="bilinear", align_corners=False)
    return torch.tanh(images)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(999)
    data = dataset(args.batch * 8, torch.Generator().manual_seed(0))
    netG, netD = Generator(), Discriminator()
    netG.apply(weights_init)
    netD.apply(weights_init)
    criterion = nn.BCELoss()
    optD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        k = step % (data.size(0) // args.batch)
        real = data[k * args.batch : (k + 1) * args.batch]
        netD.zero_grad()
        label = torch.full((args.batch,), 1.0)
        errD_real = criterion(netD(real), label)
        errD_real.backward()
        noise = torch.randn(args.batch, nz, 1, 1)
        fake = netG(noise)
        label.fill_(0.0)
        errD_fake = criterion(netD(fake.detach()), label)
        errD_fake.backward()
        optD.step()
        netG.zero_grad()
        label.fill_(1.0)
        errG = criterion(netD(fake), label)
        errG.backward()
        optG.step()
        losses.append([(errD_real + errD_fake).item(), errG.item()])
    print(json.dumps({"losses": losses, "train_s": time.perf_counter() - start}))


if __name__ == "__main__":
    main()
