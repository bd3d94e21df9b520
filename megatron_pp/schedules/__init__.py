"""Pipeline schedules as data: IR, generators, passes, validator, simulator, executor."""
