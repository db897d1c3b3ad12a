"""Words and the operating system, used by every layer: sizes and requests, the distributed
marker, the leases a report carries, counts that read right, process trees, files in shared
directories, import callbacks, and which launcher (if any) this process is a rank of."""
