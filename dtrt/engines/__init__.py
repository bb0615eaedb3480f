"""TensorRT engines (DESIGN.md section 4): `dtrt build-engine` (build.py), the machine key and engine directory
layout (keys.py), optimization profiles (profiles.py), the engine manifest and its checks (manifest.py), and
`dtrt doctor` (doctor.py). TensorRT itself is imported only where a plan is built or run."""
