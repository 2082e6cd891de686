"""The serving engine: sequences, the scheduler, the model runner and the engine loop."""
