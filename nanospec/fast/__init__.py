"""The fast path, one layer around the models: runtime.py wraps them (eager, or shape-static and replayed from CUDA
graphs) before a method sees them; graphs.py records and replays the graphs (emulated on a CPU, so the tests
check the replay without a GPU). A method never knows which path ran."""
