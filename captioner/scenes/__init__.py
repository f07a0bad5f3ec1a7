"""Scene generators in COCO format (`synthetic`, `heldout`) and the judge of a caption of a scene."""
