"""The encoder made fast for inference, after its weights are final: images (B, 3, S, S) →
annotation vectors (B, L, D), the same features, faster.

On CPU with oneDNN the VGG trunk becomes oneDNN convolutions with their ReLU fused in, weights
reordered once into oneDNN's blocked layout, activations channels-last throughout; eager torchvision
re-lays-out every layer's weights on every call. torch.compile with freezing makes the same oneDNN
calls, but needs compiling.

fp32 by default: its features agree to rounding across the kernels PyTorch and oneDNN pick (AVX2,
AVX-512, none), so a model writes the same captions and maps everywhere. bf16 is about twice as fast
on CPUs with native bf16 (AVX512-BF16 or AMX), but its features are about 3% off fp32's, which moves
scores and maps visibly. On CUDA the encoder stays fp32, so features match those the decoder was
trained on.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN's packed convolution; it is what torch.compile's CPU backend emits for a conv.
_CONV = getattr(torch.ops.mkldnn, "_convolution_pointwise", None)
_REORDER = getattr(torch.ops.mkldnn, "_reorder_convolution_weight", None)


@functools.cache
def native_bf16() -> bool:
    """True when this CPU computes in bf16 natively (AVX512-BF16 or AMX) and oneDNN supports it."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags)) and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and _CONV is not None and _REORDER is not None


# Winograd F(4×4, 3×3) (Lavin & Gray, 2016): a 3×3 convolution over 6×6 input tiles giving
# 4×4 output tiles as 36 independent matrix products, Y = Aᵀ[(G g Gᵀ) ⊙ (Bᵀ d B)]A, which
# takes 4× fewer multiplications than the direct convolution.
_BT = torch.tensor(
    [
        [4, 0, -5, 0, 1, 0],
        [0, -4, -4, 1, 1, 0],
        [0, 4, -4, -1, 1, 0],
        [0, -2, -1, 2, 1, 0],
        [0, 2, -1, -2, 1, 0],
        [0, 4, 0, -5, 0, 1],
    ],
    dtype=torch.float64,
)
_G = torch.tensor(
    [
        [1 / 4, 0, 0],
        [-1 / 6, -1 / 6, -1 / 6],
        [-1 / 6, 1 / 6, -1 / 6],
        [1 / 24, 1 / 12, 1 / 6],
        [1 / 24, -1 / 12, 1 / 6],
        [0, 0, 1],
    ],
    dtype=torch.float64,
)
_AT = torch.tensor(
    [[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]], dtype=torch.float64
)


class _WinogradConv:
    """A 3×3, stride-1, padding-1 convolution + ReLU by Winograd F(4×4, 3×3), channels-last."""

    def __init__(self, conv: nn.Conv2d, relu: bool):
        w = conv.weight.detach().to(torch.float64)  # (K, C, 3, 3)
        # G g Gᵀ per (output, input) channel pair, laid out as 36 (C, K) matrices; in fp64, then fp32.
        self.U = torch.einsum("ij,kcjl,ml->imck", _G, w, _G).reshape(36, conv.in_channels, conv.out_channels)
        self.U = self.U.float().contiguous()  # (36, C, K)
        self.bias = conv.bias.detach().float() if conv.bias is not None else torch.zeros(conv.out_channels)  # (K,)
        self.relu = relu
        self.BB = torch.kron(_BT, _BT).float()  # (36, 36): vec(Bᵀ d B) = BB vec(d)
        self.AA = torch.kron(_AT, _AT).float()  # (16, 36): vec(Aᵀ m A) = AA vec(m)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)  # (N, H, W, C): channels-last, no copy
        N, H, W, C = x.shape
        th, tw = -(-H // 4), -(-W // 4)  # output tiles down and across
        xp = F.pad(x, (0, 0, 1, 4 * tw + 1 - W, 1, 4 * th + 1 - H))  # (N, 4th+2, 4tw+2, C)
        tiles = xp.unfold(1, 6, 4).unfold(2, 6, 4)  # (N, th, tw, C, 6, 6), a view
        d = tiles.permute(4, 5, 0, 1, 2, 3).reshape(36, -1)  # (36, P·C), P = N·th·tw tiles
        v = (self.BB @ d).view(36, N * th * tw, C)  # (36, P, C), input transform
        m = torch.bmm(v, self.U)  # (36, P, K), the products
        K = m.size(2)
        # Aᵀ's column 1 is all ones, so the bias added at tile position (1, 1) reaches all 16 outputs.
        m[7].add_(self.bias)
        y = (self.AA @ m.view(36, -1)).view(4, 4, N, th, tw, K)  # (4, 4, N, th, tw, K)
        out = x.new_empty(N, th, 4, tw, 4, K)
        y = y.permute(2, 3, 0, 4, 1, 5)  # (N, th, 4, tw, 4, K), a view
        if self.relu:
            torch.clamp_min(y, 0, out=out)  # ReLU in the same pass
        else:
            out.copy_(y)
        return out.view(N, 4 * th, 4 * tw, K)[:, :H, :W].permute(0, 3, 1, 2)  # (N, K, H, W), channels-last


class _OneDNNConv:
    """A convolution (+ ReLU) through oneDNN with its weight packed once."""

    def __init__(self, conv: nn.Conv2d, relu: bool, shape: list[int], dtype: torch.dtype):
        self.args = (list(conv.padding), list(conv.stride), list(conv.dilation), conv.groups)
        self.weight = _REORDER(conv.weight.detach().to(dtype), *self.args, shape)  # oneDNN's blocked layout
        self.bias = conv.bias.detach().to(dtype) if conv.bias is not None else None
        self.attr = "relu" if relu else "none"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _CONV(x, self.weight, self.bias, *self.args, self.attr, [], "")  # (N, K, H', W')


def _winograd_fits(conv: nn.Conv2d) -> bool:
    # Where it pays: the 36 products must outweigh the tile transforms, i.e. many channels.
    return (
        conv.kernel_size == (3, 3)
        and conv.stride == (1, 1)
        and conv.padding == (1, 1)
        and conv.dilation == (1, 1)
        and conv.groups == 1
        and conv.out_channels >= WINOGRAD_MIN_CHANNELS
    )


WINOGRAD_MIN_CHANNELS = 256
FUSABLE = (nn.Conv2d, nn.ReLU, nn.MaxPool2d)  # the layers of a VGG trunk, which `FusedVGG` runs


class FusedVGG(nn.Module):
    """A VGG trunk for inference only: convolutions with their ReLU fused, weights packed once.

    `image_size` is a layout hint (any size works); `winograd` runs the wide 3×3 convolutions by
    Winograd F(4×4, 3×3) (fp32 only), the others through oneDNN.
    """

    def __init__(
        self, features: nn.Sequential, image_size: int = 224, dtype: torch.dtype = torch.float32, winograd: bool = False
    ):
        super().__init__()
        self.dtype = dtype
        # Plain attributes, not buffers: packed oneDNN tensors have no storage to save or move.
        self.layers: list = []
        shape = [1, 3, image_size, image_size]  # (1, C, S, S), the hint
        mods = list(features)
        for i, m in enumerate(mods):
            if isinstance(m, nn.Conv2d):
                relu = i + 1 < len(mods) and isinstance(mods[i + 1], nn.ReLU)
                if winograd and dtype == torch.float32 and _winograd_fits(m):
                    self.layers.append(_WinogradConv(m, relu))
                else:
                    self.layers.append(_OneDNNConv(m, relu, shape, dtype))
                shape = [1, m.out_channels, shape[2], shape[3]]
            elif isinstance(m, nn.ReLU):
                if not (i and isinstance(mods[i - 1], nn.Conv2d)):  # fused into its conv otherwise
                    self.layers.append(F.relu)
            elif isinstance(m, nn.MaxPool2d):
                self.layers.append(
                    functools.partial(
                        F.max_pool2d,
                        kernel_size=m.kernel_size,
                        stride=m.stride,
                        padding=m.padding,
                        ceil_mode=m.ceil_mode,
                    )
                )
                shape = [1, shape[1], shape[2] // 2, shape[3] // 2]
            else:
                raise TypeError(f"FusedVGG cannot run a {type(m).__name__} layer")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.dtype).contiguous(memory_format=torch.channels_last)  # (B, 3, S, S)
        for layer in self.layers:
            x = layer(x)  # (B, C, S', S')
        # Channels-last (B, D, g, g) flattens to (B, L, D) with no copy.
        return x.flatten(2).transpose(1, 2).float()  # (B, L, D)


class _ChannelsLast(nn.Module):
    """The encoder with its input made channels-last (cuDNN's fast layout on GPUs)."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder.to(memory_format=torch.channels_last)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.encoder(images.contiguous(memory_format=torch.channels_last))  # (B, L, D)


def optimize_encoder(
    encoder: nn.Module,
    device: str | torch.device = "cpu",
    *,
    image_size: int = 224,
    bf16: bool = False,
    winograd: bool = True,
) -> nn.Module:
    """The encoder, on `device`, made fast for inference, in eval mode; call it after all weights are
    loaded: its weights are a snapshot. `bf16` takes effect only on a CPU with native bf16.
    """
    device = torch.device(device)
    encoder = encoder.to(device).eval().requires_grad_(False)
    features = getattr(encoder, "features", None)
    if not isinstance(features, nn.Sequential):
        return encoder
    if device.type == "cuda":
        return _ChannelsLast(encoder).eval()
    if device.type != "cpu" or not onednn_available() or not all(isinstance(m, FUSABLE) for m in features):
        return encoder  # a ResNet's BatchNorm and residual blocks run as PyTorch runs them
    dtypes = [torch.bfloat16, torch.float32] if bf16 and native_bf16() else [torch.float32]
    for dtype in dtypes:
        try:
            return FusedVGG(features, image_size, dtype, winograd=winograd).eval()
        except (RuntimeError, TypeError):
            pass  # this CPU's oneDNN cannot take the dtype or a layer: try the next, then plain
    return encoder
