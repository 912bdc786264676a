"""Same-host transport for colocated trainer and engines: process_vm_writev on CPU, CUDA IPC on GPUs."""
