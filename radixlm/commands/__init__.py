"""The terminal commands (serve, chat, generate) and the engine flags they share."""
