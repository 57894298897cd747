"""Which rosbag2 topics and fields are a robot's joint state, its commands and its episode boundaries (a YAML file).

```yaml
joint_state:                 # sensor_msgs/msg/JointState, matched to the task's MJCF joints by name
  topic: /joint_states
  stamp: header              # header (header.stamp) or receive (the bag's receive time)
  max_age_s: 0.03            # a tick whose newest state is older than this is stale
  rename: {}                 # optional: ROS joint name -> MJCF joint name
commands:                    # std_msgs/msg/Float64MultiArray or trajectory_msgs/msg/JointTrajectory
  topic: /slide_controller/commands
  type: std_msgs/msg/Float64MultiArray
  names: [slide]             # Float64MultiArray: the actuator (or its joint) of each element of data
  field: effort              # JointTrajectory: the points[0] field that is the actuator control
  max_age_s: 0.03
episodes:
  gap_s: 0.5                 # a joint-state gap longer than this ends an episode
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

FLOAT64_MULTI_ARRAY = "std_msgs/msg/Float64MultiArray"
JOINT_TRAJECTORY = "trajectory_msgs/msg/JointTrajectory"
JOINT_STATE = "sensor_msgs/msg/JointState"


class JointStateTopic(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    topic: str = Field(min_length=1)
    stamp: Literal["header", "receive"] = Field("header", description="Which time a message is at.")
    max_age_s: float = Field(gt=0, description="Staleness limit: the newest state at a tick may be this old.")
    rename: dict[str, str] = Field(default_factory=dict, description="ROS joint name -> MJCF joint name.")


class CommandTopic(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    topic: str = Field(min_length=1)
    type: Literal["std_msgs/msg/Float64MultiArray", "trajectory_msgs/msg/JointTrajectory"] = FLOAT64_MULTI_ARRAY
    names: tuple[str, ...] = Field((), description="Float64MultiArray: actuator (or its joint) of each element.")
    field: Literal["positions", "velocities", "accelerations", "effort"] = Field(
        "effort", description="JointTrajectory: the field of points[0] that is the actuator control.")
    max_age_s: float = Field(gt=0, description="Staleness limit: the newest command in a period may be this old.")


class EpisodeBoundaries(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    gap_s: float = Field(gt=0, description="A joint-state gap longer than this starts a new episode.")


class BagMapping(BaseModel):
    """How one robot's bags map onto the task's log columns."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    joint_state: JointStateTopic
    commands: CommandTopic
    episodes: EpisodeBoundaries
    device_id: Optional[str] = Field(None, description="The log's device_id (default: rosbag:<bag name>).")
    policy_version: str = Field("rosbag", description="Who acted, as the log's policy_version.")


def load_mapping(path: Path) -> BagMapping:
    """The mapping in ``path``; ValueError naming the file and the key on a bad one."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: unreadable mapping ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    try:
        mapping = BagMapping.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(map(str, err["loc"])) or "(top level)"
        raise ValueError(f"{path}: {key}: {err['msg']} (got {err.get('input')!r})") from None
    if mapping.commands.type == FLOAT64_MULTI_ARRAY and not mapping.commands.names:
        raise ValueError(f"{path}: commands.names: a Float64MultiArray needs the actuator of each element")
    return mapping
