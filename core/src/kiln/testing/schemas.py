"""JSON schemas shared by tests and benchmarks."""

# The guided_json example of the Ascend deployment guide (seed 001): $ref/definitions and enums.
CHARACTER_SCHEMA = {
    "title": "Character",
    "type": "object",
    "properties": {
        "name": {"title": "Name", "maxLength": 10, "type": "string"},
        "age": {"title": "Age", "type": "integer"},
        "armor": {"$ref": "#/definitions/Armor"},
        "weapon": {"$ref": "#/definitions/Weapon"},
        "strength": {"title": "Strength", "type": "integer"},
    },
    "required": ["name", "age", "armor", "weapon", "strength"],
    "definitions": {
        "Armor": {"title": "Armor", "enum": ["leather", "chainmail", "plate"], "type": "string"},
        "Weapon": {"title": "Weapon", "enum": ["sword", "axe", "mace", "spear", "bow", "crossbow"], "type": "string"},
    },
}
