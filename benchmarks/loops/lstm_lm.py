"""A word-level LSTM language model, trained the way PyTorch's word_language_model example
trains it: truncated backpropagation through time over a token stream, hidden state carried
from batch to batch (detached), gradient clipping, plain SGD. The corpus is generated from
a fixed seed (a Zipf-like token stream) so the script needs no download.

    python lstm_lm.py [--steps 30]
"""

import argparse
import json
import time

import torch
from torch import nn


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.0):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nlayers, self.nhid = nlayers, nhid
        self.encoder.weight.data.uniform_(-0.1, 0.1)
        self.decoder.weight.data.uniform_(-0.1, 0.1)
        self.decoder.bias.data.zero_()

    def forward(self, inp, hidden):
        emb = self.drop(self.encoder(inp))
        output, hidden = self.rnn(emb, hidden)
        decoded = self.decoder(self.drop(output))
        return decoded.view(-1, decoded.size(-1)), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (
            weight.new_zeros(self.nlayers, bsz, self.nhid),
            weight.new_zeros(self.nlayers, bsz, self.nhid),
        )


def corpus(ntokens, length, generator):
    ranks = torch.arange(1, ntokens + 1, dtype=torch.float)
    return torch.multinomial(1.0 / ranks, length, replacement=True, generator=generator)


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--lr", type=float, default=20.0)
    args = parser.parse_args()
    torch.manual_seed(1111)
    ntokens = 2000
    data = batchify(corpus(ntokens, 60_000, torch.Generator().manual_seed(0)), args.batch)
    model = RNNModel(ntokens, 128, 128, 2)
    criterion = nn.CrossEntropyLoss()
    model.train()
    hidden = model.init_hidden(args.batch)
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        i = (step * args.bptt) % (data.size(0) - 1 - args.bptt)
        inp, target = data[i : i + args.bptt], data[i + 1 : i + 1 + args.bptt].reshape(-1)
        hidden = tuple(h.detach() for h in hidden)
        model.zero_grad()
        output, hidden = model(inp, hidden)
        loss = criterion(output, target)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-args.lr)
        losses.append(loss.item())
    print(json.dumps({"losses": losses, "train_s": time.perf_counter() - start}))


if __name__ == "__main__":
    main()
