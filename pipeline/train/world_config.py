"""The shipped `world` model's shapes: must match `ModelConfig::tiny` in pipeline/src/config.rs and
the `world` tiny-decoder/encoder config in pipeline/src/vae/tiny.rs."""

DIT = dict(dim=128, ffn_dim=256, num_heads=4, num_layers=2, text_dim=64, text_len=32, freq_dim=256,
           control_dim=6)

AE = dict(latent=16, dec_widths=(64, 64, 32, 32), enc_widths=(32, 32, 64, 64), mem_blocks=2,
          time_upscale=(False, True, True), time_downscale=(True, True, False))
