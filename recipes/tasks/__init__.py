"""The tasks a recipe trains (language modelling, translation, masked LM, classification)."""
