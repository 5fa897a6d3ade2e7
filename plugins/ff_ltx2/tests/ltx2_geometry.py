"""The geometry every ff-ltx2 test runs at: 9 frames of 32x32 at 8 fps (5 latent frames of 4x4: 80 video tokens),
1.125 s of audio (28 audio latent frames)."""

SIZE, FRAMES, FPS = 32, 9, 8.0
ADAPTER_KWARGS = {"height": SIZE, "width": SIZE, "num_frames": FRAMES, "frame_rate": FPS}
AUDIO_RATE, AUDIO_LATENTS = 16000, 28
# LTX2Pipeline.__call__ with its extra guidance terms off (STG, modality isolation, rescale): plain CFG, the same
# scale for both streams, as ff samples.
PLAIN_GUIDANCE = {"stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0,
                  "guidance_rescale": 0.0, "audio_guidance_rescale": 0.0, "spatio_temporal_guidance_blocks": None}
