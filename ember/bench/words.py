"""The word list prompts are drawn from: common English words, so every tokenizer handles them."""

WORDS: tuple[str, ...] = tuple("""
able about above across act add after again against age ago agree air all almost alone along already also
always among amount animal answer any appear apple area arm army around arrive art ask at away baby back bad
ball bank base basket bear beat beauty bed before begin behind believe bell below best better between big bird
black block blood blow blue board boat body bone book born both bottom box boy branch bread break bridge
bright bring broad brother brown build burn busy buy call calm camp can capital captain car card care carry
case cat catch cause cell center certain chair chance change charge check child choose circle city class
clean clear climb clock close cloth cloud coast coat cold color column come common company compare complete
cook cool copy corn corner cost cotton could count country course cover cow create crop cross crowd cry
current cut dance dark day dead deal dear death decide deep degree depend desert design detail develop
differ direct discover distant divide doctor dog dollar door double down draw dream dress drink drive drop
dry during duty each ear early earth east easy eat edge effect egg eight either electric element else end
enemy energy engine enough enter equal even evening event ever every exact example except exercise expect
experience explain eye face fact fair fall family famous far farm fast father fear feed feel few field fight
figure fill final find fine finger finish fire first fish fit five flat floor flow flower fly follow food
foot force forest form forward found four free fresh friend front fruit full game garden gas gather gentle
get girl give glad glass go gold good govern grass great green ground group grow guess guide hair half hand
happen happy hard hat have head hear heart heat heavy help here high hill history hold hole home hope horse
hot hour house huge human hundred hunt hurry ice idea inch include industry insect instant iron island job
join joy jump just keep key kind king kitchen know lady lake land language large last late laugh law lay
lead learn leave left leg length letter level lie life lift light like line liquid list listen little live
long look lost loud love low machine main make man many map mark market mass master match material matter
meat meet melody metal method middle might mile milk million mind minute miss mix modern moment money month
moon more morning most mother motion mountain mouth move music name nation natural nature near neck need
neighbor never new next night nine noise north nose note nothing notice number object observe ocean offer
office often oil old once only open order other outside over own oxygen page paint pair paper parent part
party pass past path pattern pay people perhaps period person picture piece place plain plan plane planet
plant play please plenty poem point poor port position possible pound power practice prepare present press
pretty print probable problem process produce product proper protect proud prove provide pull push quick
quiet quite race radio rain raise range rather reach read ready real reason receive record red region remember
repeat reply rest result rich ride right ring rise river road rock roll room root rope rose round row rule
run safe sail salt same sand save say scale school science score sea season seat second section see seed
seem select self sell send sense sentence separate serve set settle seven several shape share sharp sheet
shell shine ship shoe shop shore short shoulder show side sight sign silent silver simple since sing single
sister sit six size skill skin sky sleep slow small smell smile snow soft soil soldier solution some son
song soon sound south space speak special speed spell spend spring square stand star start state station
stay steam steel step stick still stone stood stop store story straight strange stream street strong student
study subject success sudden sugar suit summer sun supply support sure surface surprise swim system table
tail take talk tall teach team tell temperature ten term test thank thick thin thing think third thought
thousand three through throw tie time tiny together tool top total touch toward town track trade train travel
tree triangle trip trouble truck true try tube turn twenty type under unit until use usual valley value
various very view village visit voice vowel wait walk wall want warm wash watch water wave way wear weather
week weight west wheel white whole wide wife wild will win wind window winter wire wish woman wonder wood
word work world write yard year yellow young
""".split())
