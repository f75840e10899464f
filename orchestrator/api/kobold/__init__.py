"""KoboldCpp's API, as KoboldAI Lite and SillyTavern use it."""
