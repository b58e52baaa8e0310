"""The shipped `world` model's shapes: must match `ModelConfig::tiny` in pipeline/src/config.rs and
the `world` tiny-decoder/encoder config in pipeline/src/vae/tiny.rs."""

DIT = dict(dim=128, ffn_dim=256, num_heads=4, num_layers=2, text_dim=64, text_len=32, freq_dim=256,
           control_dim=6)

AE = dict(latent=16, dec_widths=(64, 48, 32, 24), enc_widths=(32, 32, 32, 32), mem_blocks=2,
          time_upscale=(False, True, True), time_downscale=(True, True, False))

# The autoencoder: `TinyDecoderConfig::world` and `TinyEncoderConfig::world` (width 32 in every
# encoder stage) of pipeline/src/vae/, layouts in their module docs. The stream's first frame is
# repeated three times in front (latent 0 = frame 0 alone; latent j = frames 4j−3..4j).
