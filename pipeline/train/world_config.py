"""The shipped `world` model's shapes: must match `ModelConfig::tiny` in pipeline/src/config.rs and
the `world` tiny-decoder/encoder config in pipeline/src/vae/tiny.rs."""

DIT = dict(dim=128, ffn_dim=256, num_heads=4, num_layers=2, text_dim=64, text_len=32, freq_dim=256,
           control_dim=6)

AE = dict(latent=16, dec_widths=(64, 32, 16, 16), enc_widths=(32, 48, 64, 64), mem_blocks=2,
          time_upscale=(False, True, True), time_downscale=(True, True, False))

# The autoencoder (proposal for the Rust `world` config; names as TAEHV):
#   encoder: 0 conv3x3 3→e0 (bias), 1 ReLU, then per stage s=0,1,2: TPool(e_s, ×2,×2,×1: 1×1 conv
#   [e_s, 2·e_s or e_s] no bias; frame j of a group = channel block j), conv3x3 stride 2 e_s→e_{s+1}
#   no bias, mem_blocks MemBlock(e_{s+1}); last: conv3x3 e3→16 (bias).
#   The stream's first frame is repeated to fill its group of four (3 copies in front), so
#   latent 0 = frame 0 alone and latent j = frames 4j−3..4j (what the decoder gives back for it).
#   Input frames are mapped [−1, 1] → [0, 1] before the first conv (TAEHV's range).
#   decoder: the existing TinyDecoder layout with widths dec_widths and mem_blocks blocks per stage.
