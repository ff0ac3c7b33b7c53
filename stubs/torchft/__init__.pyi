# The parts of torchft 0.2.0 the torchft tests use (torchft ships no type information).
