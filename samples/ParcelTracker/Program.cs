using ParcelTracker;
using ParcelTracker.Hosting;

// dotnet run --project samples/ParcelTracker [-- all|api|consumer|worker|demo] [--postgres "<connection string>" --rabbitmq "amqp://…"]
string role = args.Length > 0 && !args[0].StartsWith('-') ? args[0].ToLowerInvariant() : "all";
string[] rest = args.Length > 0 && !args[0].StartsWith('-') ? args[1..] : args;
if (role == "demo")
{
    return await Demo.RunAsync(rest);
}

// Roles combine with commas: "consumer,worker" runs the consumers and the dispatcher in one process.
Roles roles = Roles.None;
foreach (string name in role.Split(','))
{
    Roles one = name switch
    {
        "all" => Roles.All,
        "api" => Roles.Api,
        "consumer" => Roles.Consumer,
        "worker" => Roles.Worker,
        _ => Roles.None,
    };
    if (one == Roles.None)
    {
        Console.Error.WriteLine($"Unknown role '{name}'. Use one of: all (default), api, consumer, worker (or a comma-separated combination), demo.");
        return 2;
    }

    roles |= one;
}

var app = ParcelTrackerApp.Build(roles, rest);
await app.RunAsync();
return 0;
