"""The tiny TAEHV-kind autoencoder in PyTorch, with the `decoder.N.*` / `encoder.N.*` names of
`pipeline/src/vae/tiny.rs` (one `nn.Sequential` each, so `state_dict()` is the checkpoint).

Tensors are [B, C, T, H, W]; every layer runs on all time steps at once; a memory block reads the
previous step of its input through a one-frame shift with zeros in front (the Rust streams the
same thing with one held frame per block, so whole-clip training equals chunked streaming).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def frames_conv(conv, x):
    b, c, t, h, w = x.shape
    y = conv(x.transpose(1, 2).reshape(b * t, c, h, w))
    return y.view(b, t, *y.shape[1:]).transpose(1, 2)


class Conv(nn.Module):
    """Per-frame Conv2d with 'same' padding (or stride 2, as the encoder's downsampling)."""

    def __init__(self, cin, cout, k=3, bias=True, stride=1):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cout, cin, k, k))
        self.bias = nn.Parameter(torch.zeros(cout)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
        self.pad, self.stride = (k - 1) // 2, stride

    def forward(self, x):
        b, c, t, h, w = x.shape
        y = F.conv2d(x.transpose(1, 2).reshape(b * t, c, h, w), self.weight, self.bias,
                     stride=self.stride, padding=self.pad)
        return y.view(b, t, *y.shape[1:]).transpose(1, 2)


class Clamp(nn.Module):
    def forward(self, x):
        return torch.tanh(x / 3.0) * 3.0


class Relu(nn.Module):
    def forward(self, x):
        return F.relu(x)


class MemBlock(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Sequential(Conv(2 * cin, cout), Relu(), Conv(cout, cout), Relu(), Conv(cout, cout))
        self.skip = Conv(cin, cout, 1, bias=False) if cin != cout else None

    def forward(self, x):
        past = torch.cat([torch.zeros_like(x[:, :, :1]), x[:, :, :-1]], 2)
        h = self.conv(torch.cat([x, past], 1))
        return F.relu(h + (self.skip(x) if self.skip is not None else x))


class Upsample(nn.Module):
    def forward(self, x):
        return x.repeat_interleave(2, 3).repeat_interleave(2, 4)


class TGrow(nn.Module):
    """1×1 conv to stride·C channels; channel block j of step t becomes frame stride·t + j."""

    def __init__(self, c, stride):
        super().__init__()
        self.conv = Conv(c, c * stride, 1, bias=False)
        self.stride = stride

    def forward(self, x):
        b, c, t, h, w = x.shape
        y = self.conv(x)
        if self.stride == 1:
            return y
        return y.view(b, self.stride, c, t, h, w).permute(0, 2, 3, 1, 4, 5).reshape(b, c, t * self.stride, h, w)


class TPool(nn.Module):
    """Encoder's time pooling: `stride` consecutive frames side by side in channels (frame j of a
    group is channel block j), then a bias-free 1×1 conv back to C."""

    def __init__(self, c, stride):
        super().__init__()
        self.conv = Conv(c * stride, c, 1, bias=False)
        self.stride = stride

    def forward(self, x):
        b, c, t, h, w = x.shape
        s = self.stride
        if s > 1:
            x = x.view(b, c, t // s, s, h, w).permute(0, 3, 1, 2, 4, 5).reshape(b, s * c, t // s, h, w)
        return self.conv(x)


def decoder_layers(latent, widths, mem_blocks, time_upscale):
    w = widths
    layers = [Clamp(), Conv(latent, w[0]), Relu()]
    for s in range(3):
        layers += [MemBlock(w[s], w[s]) for _ in range(mem_blocks)]
        layers += [Upsample(), TGrow(w[s], 2 if time_upscale[s] else 1), Conv(w[s], w[s + 1], bias=False)]
    layers += [Relu(), Conv(w[3], 3)]
    return nn.Sequential(*layers)


def encoder_layers(latent, widths, mem_blocks, time_downscale):
    """TAEHV's encoder: conv 3→w0, ReLU; per stage s: TPool (×2 or ×1), stride-2 conv w→w_{s+1}
    without bias, memory blocks; a 3×3 conv to the latent channels."""
    w = widths
    layers = [Conv(3, w[0]), Relu()]
    for s in range(3):
        layers += [TPool(w[s], 2 if time_downscale[s] else 1), Conv(w[s], w[s + 1], bias=False, stride=2)]
        layers += [MemBlock(w[s + 1], w[s + 1]) for _ in range(mem_blocks)]
    layers += [Conv(w[3], latent)]
    return nn.Sequential(*layers)


class TinyAE(nn.Module):
    def __init__(self, latent=16, dec_widths=(64, 64, 32, 32), enc_widths=(32, 32, 64, 64), mem_blocks=2,
                 time_upscale=(False, True, True), time_downscale=(True, True, False)):
        super().__init__()
        self.encoder = encoder_layers(latent, enc_widths, mem_blocks, time_downscale)
        self.decoder = decoder_layers(latent, dec_widths, mem_blocks, time_upscale)
        self.t_stride = 2 ** sum(time_upscale)

    def encode(self, frames):
        """frames [B, 3, 1+4k, H, W] in [−1, 1] → latents [B, 16, 1+k, H/8, W/8]. The first frame
        is repeated to fill its group of four (so latent 0 sees frame 0 only and latent j frames
        4j−3..4j, the frames it decodes to)."""
        x = (frames + 1) / 2
        first = x[:, :, :1].expand(-1, -1, self.t_stride - 1, -1, -1)
        return self.encoder(torch.cat([first, x], 2))

    def decode_raw(self, latents):
        return self.decoder(latents)

    def decode(self, latents):
        """latents [B, 16, K, h, w] → frames [B, 3, 1+4(K−1), 8h, 8w] in [−1, 1] (unclamped)."""
        y = self.decoder(latents)
        return y[:, :, self.t_stride - 1:] * 2 - 1
