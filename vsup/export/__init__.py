"""`vsup export`: a machine's plan as the placement of another engine (Kubernetes, Slurm).

Pure functions from the machine, its plan and the config to objects and text; the command
(vsup/cli/export.py) reads the machine and writes the files. `pod.py` shapes one
pod (one NUMA node's share), `kubernetes.py` turns it into manifests and the kubelet fragment,
`slurm.py` turns the plan into an sbatch script, `yamltext.py` writes YAML with comments."""
