"""The live gateway: an OpenAI-compatible proxy that assigns real users by the same
router as every other process, forwards to their variant and measures each request."""
