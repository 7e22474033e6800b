"""One rank's device side: the model runner, the step's flat inputs, CUDA graphs (decode and
piecewise mixed steps) and the memory plan."""
