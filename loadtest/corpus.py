"""Bundled text for the chat-style dataset and the word-based random prompts.

Written for this project (no licence strings attached): short passages on everyday
subjects and instructions a user might give about them. A chat request is one passage
plus one instruction, so 16 x 12 distinct conversations come out of it before any repeats.
"""

from __future__ import annotations

PASSAGES = (
    "The lighthouse on the northern cape was built in 1874 from granite blocks shipped "
    "down the coast by barge. For ninety years a keeper climbed its 212 steps every evening "
    "to trim the wick and wind the clockwork that turned the lens. When the light was "
    "automated, the keeper's cottage became a small museum with his logbooks on display.",
    "Honeybees choose a new home by a kind of vote. Scouts fly out, inspect hollow trees "
    "and wall cavities, and return to dance for the sites they like. The better the site, "
    "the longer the dance, so good sites recruit more scouts, until one site has enough "
    "supporters at once and the whole swarm lifts off towards it.",
    "A sourdough starter is a mixture of flour and water in which wild yeasts and lactic "
    "acid bacteria live together. The bacteria make the bread sour; the yeasts make it rise. "
    "Bakers feed the starter every day with fresh flour, and a well-kept starter can outlive "
    "the baker who began it.",
    "Compound interest means that interest is paid on earlier interest as well as on the "
    "original sum. At five percent a year, a deposit doubles in about fourteen years; at "
    "ten percent, in a little over seven. The rule of seventy-two gives a quick estimate: "
    "divide seventy-two by the rate to get the years needed to double.",
    "The water cycle moves water between the oceans, the air and the land. Sunlight "
    "evaporates water from the sea, the vapour cools as it rises and condenses into clouds, "
    "and rain or snow returns it to the ground, where rivers and groundwater carry it back "
    "to the sea over days, years or thousands of years.",
    "The printing press with movable type spread across Europe within fifty years of its "
    "invention. Books that had taken a scribe months to copy could be produced in hundreds "
    "within weeks, prices fell, and pamphlets, newspapers and scientific journals followed. "
    "Literacy rose fastest in the towns that had a press.",
    "A night train from the capital to the mountains leaves at ten and arrives just after "
    "dawn. Passengers sleep in narrow bunks while the train climbs through tunnels and over "
    "viaducts; in the morning the conductor brings tea, and the windows show snow-covered "
    "pines where the evening had shown city lights.",
    "Vaccines train the immune system by showing it a harmless piece or copy of a germ. "
    "The body makes antibodies and memory cells against it, so that if the real germ "
    "arrives later the defence is ready within hours instead of days. Booster doses remind "
    "the memory cells when their numbers fade.",
    "A community garden on a vacant lot began with six raised beds and a borrowed hose. "
    "Five years later it has forty beds, a tool shed, a rain-water tank and a waiting list. "
    "Members share seeds in spring, hold a harvest supper in autumn, and give a tenth of "
    "their vegetables to the food bank down the street.",
    "Stars form in cold clouds of gas that collapse under their own gravity. A star like "
    "the Sun burns hydrogen for about ten billion years, then swells into a red giant and "
    "sheds its outer layers, leaving a white dwarf. Much heavier stars end in supernova "
    "explosions that scatter the elements of future planets.",
    "The old chess club meets on Thursday evenings above a bakery. Members range from "
    "schoolchildren to retired engineers, and the strongest player is a quiet woman who "
    "learned the game at sixty. Every winter the club holds a tournament whose prize is a "
    "cake from the bakery downstairs.",
    "Rivers carve valleys slowly, grain by grain, but floods can change a river's course in "
    "a single night. Engineers build levees to hold rivers in place, yet ecologists point "
    "out that floodplains store water, filter it, and give fish places to breed, so many "
    "towns now leave room for the river to spread.",
    "A small robot vacuum maps a flat by bumping into walls and furniture and remembering "
    "where it has been. After a few runs it knows the rooms, plans straight lanes across "
    "open floors, and returns to its dock to recharge, although a sock left on the carpet "
    "can still stop it in its tracks.",
    "The telephone turned sound into a varying electric current and back again. Early "
    "exchanges needed operators to connect each call by hand with cords and plugs; "
    "automatic switches replaced them in the twentieth century, and today most calls "
    "travel as packets of digital data over the same networks as everything else.",
    "A mountain hut above the tree line offers beds, soup and shelter to walkers crossing "
    "the pass. The warden carries supplies up by mule in summer and by helicopter before "
    "the first snow, keeps a weather log, and knows from the colour of the evening sky "
    "whether the next day will be safe for the crossing.",
    "Public libraries lend far more than books: many lend tools, musical instruments, "
    "board games and telescopes. A library card is free, the reading rooms are warm, and "
    "librarians help people fill in forms, find jobs and learn to use computers, which "
    "makes the library one of the busiest rooms in town.",
)

INSTRUCTIONS = (
    "Summarise the passage above in two sentences.",
    "Explain the passage above to a ten-year-old, with one everyday example.",
    "Write three questions a teacher could ask about the passage above, with answers.",
    "Rewrite the passage above as a short poem of eight lines.",
    "List the main facts in the passage above as bullet points.",
    "Write a short story of about one hundred words inspired by the passage above.",
    "What is the most surprising detail in the passage above, and why?",
    "Translate the main idea of the passage above into plain business language.",
    "Write a headline and a one-paragraph news item based on the passage above.",
    "Give two arguments for and two against the idea described in the passage above.",
    "Describe the scene in the passage above from the point of view of someone in it.",
    "Suggest a title for the passage above and explain your choice in one sentence.",
)


# Input-grounded work (the `grounded` dataset): the answer quotes the input, which is where
# prompt-lookup speculative decoding pays off.
GROUNDED_INSTRUCTIONS = (
    "Repeat the passage above word for word.",
    "Rewrite the passage above with every number written out in words; keep everything else exactly as it is.",
    "Summarise the passage above by quoting its two most important sentences exactly.",
    "Copy the passage above, then add one sentence at the end that explains why it matters.",
)

CODE_SNIPPETS = (
    "def moving_average(values, window):\n"
    "    result = []\n"
    "    for i in range(len(values) - window + 1):\n"
    "        total = 0\n"
    "        for j in range(window):\n"
    "            total += values[i + j]\n"
    "        result.append(total / window)\n"
    "    return result\n",
    "class Inventory:\n"
    "    def __init__(self):\n"
    "        self.items = {}\n"
    "\n"
    "    def add(self, name, count):\n"
    "        self.items[name] = self.items.get(name, 0) + count\n"
    "\n"
    "    def remove(self, name, count):\n"
    "        if self.items.get(name, 0) < count:\n"
    "            raise ValueError('not enough ' + name)\n"
    "        self.items[name] -= count\n",
    "def parse_config(path):\n"
    "    config = {}\n"
    "    with open(path) as f:\n"
    "        for line in f:\n"
    "            line = line.strip()\n"
    "            if not line or line.startswith('#'):\n"
    "                continue\n"
    "            key, value = line.split('=', 1)\n"
    "            config[key.strip()] = value.strip()\n"
    "    return config\n",
)

CODE_EDITS = (
    "Add type hints to every function in the code above and return the whole file.",
    "Add a docstring to every function in the code above and return the whole file.",
    "Rename the variables in the code above to longer, clearer names and return the whole file.",
)


def words() -> list[str]:
    """Every word of the passages, in order (for word-based random prompts)."""
    return [w for p in PASSAGES for w in p.split()]
