"""What a spec costs, torch-free: exact parameters and FLOPs (``estimates``), memory per device
(``memory``), where each parameter lives on a layout (``layout``), the launch planner (``plan``),
model FLOPs utilisation (``mfu``) and the tables and plots that show them (``report``)."""
