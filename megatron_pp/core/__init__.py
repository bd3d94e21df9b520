"""Process groups, tensor-parallel layers, pipeline point-to-point communication."""
