"""The geometry every ff-wan test runs at: 9 frames (3 latent frames) of 32x32 (4x4 latents, 2x2 tokens a frame)."""

SIZE, FRAMES, FPS = 32, 9, 8.0
ADAPTER_KWARGS = {"height": SIZE, "width": SIZE, "num_frames": FRAMES, "fps": FPS}
