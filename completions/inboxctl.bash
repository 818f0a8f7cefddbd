_inboxctl() {
    local i cur prev opts cmd
    COMPREPLY=()
    if [[ "${BASH_VERSINFO[0]}" -ge 4 ]]; then
        cur="$2"
    else
        cur="${COMP_WORDS[COMP_CWORD]}"
    fi
    prev="$3"
    cmd=""
    opts=""

    for i in "${COMP_WORDS[@]:0:COMP_CWORD}"
    do
        case "${cmd},${i}" in
            ",$1")
                cmd="inboxctl"
                ;;
            inboxctl,audit)
                cmd="inboxctl__subcmd__audit"
                ;;
            inboxctl,carrier-stub)
                cmd="inboxctl__subcmd__carrier__subcmd__stub"
                ;;
            inboxctl,cleanup)
                cmd="inboxctl__subcmd__cleanup"
                ;;
            inboxctl,completions)
                cmd="inboxctl__subcmd__completions"
                ;;
            inboxctl,consume)
                cmd="inboxctl__subcmd__consume"
                ;;
            inboxctl,demo)
                cmd="inboxctl__subcmd__demo"
                ;;
            inboxctl,effects)
                cmd="inboxctl__subcmd__effects"
                ;;
            inboxctl,failures)
                cmd="inboxctl__subcmd__failures"
                ;;
            inboxctl,find)
                cmd="inboxctl__subcmd__find"
                ;;
            inboxctl,help)
                cmd="inboxctl__subcmd__help"
                ;;
            inboxctl,migrate)
                cmd="inboxctl__subcmd__migrate"
                ;;
            inboxctl,publish)
                cmd="inboxctl__subcmd__publish"
                ;;
            inboxctl,replay)
                cmd="inboxctl__subcmd__replay"
                ;;
            inboxctl,stats)
                cmd="inboxctl__subcmd__stats"
                ;;
            inboxctl,top)
                cmd="inboxctl__subcmd__top"
                ;;
            inboxctl__subcmd__effects,help)
                cmd="inboxctl__subcmd__effects__subcmd__help"
                ;;
            inboxctl__subcmd__effects,reconcile)
                cmd="inboxctl__subcmd__effects__subcmd__reconcile"
                ;;
            inboxctl__subcmd__effects,resolve)
                cmd="inboxctl__subcmd__effects__subcmd__resolve"
                ;;
            inboxctl__subcmd__effects__subcmd__help,help)
                cmd="inboxctl__subcmd__effects__subcmd__help__subcmd__help"
                ;;
            inboxctl__subcmd__effects__subcmd__help,reconcile)
                cmd="inboxctl__subcmd__effects__subcmd__help__subcmd__reconcile"
                ;;
            inboxctl__subcmd__effects__subcmd__help,resolve)
                cmd="inboxctl__subcmd__effects__subcmd__help__subcmd__resolve"
                ;;
            inboxctl__subcmd__help,audit)
                cmd="inboxctl__subcmd__help__subcmd__audit"
                ;;
            inboxctl__subcmd__help,carrier-stub)
                cmd="inboxctl__subcmd__help__subcmd__carrier__subcmd__stub"
                ;;
            inboxctl__subcmd__help,cleanup)
                cmd="inboxctl__subcmd__help__subcmd__cleanup"
                ;;
            inboxctl__subcmd__help,completions)
                cmd="inboxctl__subcmd__help__subcmd__completions"
                ;;
            inboxctl__subcmd__help,consume)
                cmd="inboxctl__subcmd__help__subcmd__consume"
                ;;
            inboxctl__subcmd__help,demo)
                cmd="inboxctl__subcmd__help__subcmd__demo"
                ;;
            inboxctl__subcmd__help,effects)
                cmd="inboxctl__subcmd__help__subcmd__effects"
                ;;
            inboxctl__subcmd__help,failures)
                cmd="inboxctl__subcmd__help__subcmd__failures"
                ;;
            inboxctl__subcmd__help,find)
                cmd="inboxctl__subcmd__help__subcmd__find"
                ;;
            inboxctl__subcmd__help,help)
                cmd="inboxctl__subcmd__help__subcmd__help"
                ;;
            inboxctl__subcmd__help,migrate)
                cmd="inboxctl__subcmd__help__subcmd__migrate"
                ;;
            inboxctl__subcmd__help,publish)
                cmd="inboxctl__subcmd__help__subcmd__publish"
                ;;
            inboxctl__subcmd__help,replay)
                cmd="inboxctl__subcmd__help__subcmd__replay"
                ;;
            inboxctl__subcmd__help,stats)
                cmd="inboxctl__subcmd__help__subcmd__stats"
                ;;
            inboxctl__subcmd__help,top)
                cmd="inboxctl__subcmd__help__subcmd__top"
                ;;
            inboxctl__subcmd__help__subcmd__effects,reconcile)
                cmd="inboxctl__subcmd__help__subcmd__effects__subcmd__reconcile"
                ;;
            inboxctl__subcmd__help__subcmd__effects,resolve)
                cmd="inboxctl__subcmd__help__subcmd__effects__subcmd__resolve"
                ;;
            inboxctl__subcmd__help__subcmd__publish,parcel-created)
                cmd="inboxctl__subcmd__help__subcmd__publish__subcmd__parcel__subcmd__created"
                ;;
            inboxctl__subcmd__publish,help)
                cmd="inboxctl__subcmd__publish__subcmd__help"
                ;;
            inboxctl__subcmd__publish,parcel-created)
                cmd="inboxctl__subcmd__publish__subcmd__parcel__subcmd__created"
                ;;
            inboxctl__subcmd__publish__subcmd__help,help)
                cmd="inboxctl__subcmd__publish__subcmd__help__subcmd__help"
                ;;
            inboxctl__subcmd__publish__subcmd__help,parcel-created)
                cmd="inboxctl__subcmd__publish__subcmd__help__subcmd__parcel__subcmd__created"
                ;;
            *)
                ;;
        esac
    done

    case "${cmd}" in
        inboxctl)
            opts="-v -h -V --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 1 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__audit)
            opts="-v -h -V --since --command --limit --json --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --since)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --command)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --limit)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__carrier__subcmd__stub)
            opts="-v -h -V --listen --ignore-keys --delay --delay-destination --fail-next --fail-always --drop-next --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --listen)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --delay)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --delay-destination)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --fail-next)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --drop-next)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__cleanup)
            opts="-v -h -V --retention --force --dlq --broker-timeout --audit-retention --detach-wait --consumer-type --batch-size --batch-pause --dry-run --every --metrics-addr --json --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --retention)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --dlq)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --broker-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --audit-retention)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --detach-wait)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --consumer-type)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --batch-size)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --batch-pause)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --every)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --metrics-addr)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__completions)
            opts="-v -h -V --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version bash elvish fish powershell zsh"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__consume)
            opts="-v -h -V --queue --exchange --queue-type --consumer-type --prefetch --concurrency --pool-size --max-attempts --retry-delay --claim-timeout --attempt-timeout --exit-when-idle --shutdown-timeout --broker-timeout --batch-size --batch-wait --poison-after --on-conflict --metrics-addr --partitions --partition-key --fail-destination --carrier-url --carrier-timeout --carrier-connect-timeout --effect-mode --effect-key-ttl --effect-lease --lookup-url --lookup-quiet --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version carrier notification"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --queue)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --exchange)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --queue-type)
                    COMPREPLY=($(compgen -W "classic quorum" -- "${cur}"))
                    return 0
                    ;;
                --consumer-type)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --prefetch)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --concurrency)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --pool-size)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --max-attempts)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --retry-delay)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --claim-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --attempt-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --exit-when-idle)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --shutdown-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --broker-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --batch-size)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --batch-wait)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --poison-after)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --on-conflict)
                    COMPREPLY=($(compgen -W "dead-letter discard" -- "${cur}"))
                    return 0
                    ;;
                --metrics-addr)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --partitions)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --partition-key)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --fail-destination)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --carrier-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --carrier-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --carrier-connect-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --effect-mode)
                    COMPREPLY=($(compgen -W "keyed after-commit at-most-once" -- "${cur}"))
                    return 0
                    ;;
                --effect-key-ttl)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --effect-lease)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --lookup-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --lookup-quiet)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__demo)
            opts="-v -h -V --parcels --duplicates --carrier --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --parcels)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --duplicates)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --carrier)
                    COMPREPLY=($(compgen -W "stand-in http" -- "${cur}"))
                    return 0
                    ;;
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__effects)
            opts="-v -h -V --in-doubt --pending --failed --consumer-type --limit --json --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version resolve reconcile help"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --consumer-type)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --limit)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__effects__subcmd__help)
            opts="resolve reconcile help"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__effects__subcmd__help__subcmd__help)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 4 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__effects__subcmd__help__subcmd__reconcile)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 4 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__effects__subcmd__help__subcmd__resolve)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 4 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__effects__subcmd__reconcile)
            opts="-v -h -V --lookup-url --consumer-type --timeout --quiet-for --json --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --lookup-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --consumer-type)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --quiet-for)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__effects__subcmd__resolve)
            opts="-v -h -V --consumer-type --done --reference --never-attempted --retry --quiet-for --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --consumer-type)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --reference)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --quiet-for)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__failures)
            opts="-v -h -V --from --limit --output --broker-timeout --json --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --from)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --limit)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --output)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --broker-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__find)
            opts="-v -h -V --dlq --limit --broker-timeout --json --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --dlq)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --limit)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --broker-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help)
            opts="migrate consume cleanup replay find failures publish top stats demo effects audit carrier-stub completions help"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__audit)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__carrier__subcmd__stub)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__cleanup)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__completions)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__consume)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__demo)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__effects)
            opts="resolve reconcile"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__effects__subcmd__reconcile)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 4 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__effects__subcmd__resolve)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 4 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__failures)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__find)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__help)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__migrate)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__publish)
            opts="parcel-created"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__publish__subcmd__parcel__subcmd__created)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 4 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__replay)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__stats)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__help__subcmd__top)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__migrate)
            opts="-v -h -V --dry-run --partitioned --partition-time --partition-back --new-inbox --json --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --partitioned)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --partition-time)
                    COMPREPLY=($(compgen -W "id sent-time timestamp" -- "${cur}"))
                    return 0
                    ;;
                --partition-back)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__publish)
            opts="-v -h -V --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version parcel-created help"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__publish__subcmd__help)
            opts="parcel-created help"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__publish__subcmd__help__subcmd__help)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 4 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__publish__subcmd__help__subcmd__parcel__subcmd__created)
            opts=""
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 4 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__publish__subcmd__parcel__subcmd__created)
            opts="-v -h -V --count --duplicates --rate --destination --id-kind --events-per-parcel --partition-key --exchange --reconnect-timeout --broker-timeout --json --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 3 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --count)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --duplicates)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --rate)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --destination)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --id-kind)
                    COMPREPLY=($(compgen -W "newid v7 v4" -- "${cur}"))
                    return 0
                    ;;
                --events-per-parcel)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --partition-key)
                    COMPREPLY=($(compgen -W "parcelId trackingNumber destination" -- "${cur}"))
                    return 0
                    ;;
                --exchange)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --reconnect-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --broker-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__replay)
            opts="-y -v -h -V --from --to --limit --message-id --reason --max-replays --retention --include-expired --restore-expiration --group --listing --rate --confirm-above --yes --dry-run --reconnect-timeout --broker-timeout --json --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --from)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --to)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --limit)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --message-id)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --reason)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --max-replays)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --retention)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --group)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --listing)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --rate)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --confirm-above)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --reconnect-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --broker-timeout)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__stats)
            opts="-v -h -V --window --retention --json --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --window)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --retention)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
        inboxctl__subcmd__top)
            opts="-v -h -V --interval --window --retention --read-only --alert-duplicates --database-url --amqp-url --database-password-file --amqp-password-file --amqp-ca-file --transaction-pooling --verbose --log-format --help --version"
            if [[ ${cur} == -* || ${COMP_CWORD} -eq 2 ]] ; then
                COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
                return 0
            fi
            case "${prev}" in
                --interval)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --window)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --retention)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --alert-duplicates)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-url)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --database-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-password-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --amqp-ca-file)
                    COMPREPLY=($(compgen -f "${cur}"))
                    return 0
                    ;;
                --log-format)
                    COMPREPLY=($(compgen -W "text json" -- "${cur}"))
                    return 0
                    ;;
                *)
                    COMPREPLY=()
                    ;;
            esac
            COMPREPLY=( $(compgen -W "${opts}" -- "${cur}") )
            return 0
            ;;
    esac
}

if [[ "${BASH_VERSINFO[0]}" -eq 4 && "${BASH_VERSINFO[1]}" -ge 4 || "${BASH_VERSINFO[0]}" -gt 4 ]]; then
    complete -F _inboxctl -o nosort -o bashdefault -o default inboxctl
else
    complete -F _inboxctl -o bashdefault -o default inboxctl
fi
