"""Long chains of thought: who runs out of memory first, and where a step's time goes."""
